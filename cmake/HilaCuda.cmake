# SPDX-License-Identifier: Apache-2.0
# Whether hila builds its CUDA backend, and for which GPU architectures.
#
#   HILA_CUDA          ON    the CUDA backend is required: configuring fails, naming the fix, when
#                            no working nvcc is found
#                      OFF   CPU backend only
#                      AUTO  (default) ON when a working nvcc is found, else OFF; the choice is printed
#   HILA_CUDA_GENCODE  nvcc -gencode flags (a CMake list). The default is what the wheels ship:
#                      sm_90a code (TMA + wgmma kernels, H100/H200), sm_80 code (the portable
#                      mma.sync kernels; runs on every 8.x GPU) and compute_90 PTX of the portable
#                      kernels, which the driver compiles for GPUs newer than Hopper (sm_90a code
#                      cannot be PTX for them). One GPU: e.g. -gencode=arch=compute_90a,code=sm_90a.
#
# nvcc is looked up as CMake does (CMAKE_CUDA_COMPILER, CUDACXX, PATH), then in $CUDA_HOME/bin,
# $CUDA_PATH/bin and /usr/local/cuda/bin, so a toolkit that is installed but not on PATH is found.
# Sets HILA_CUDA_ENABLED (ON/OFF) and HILA_CUDA_ARCHS (e.g. "sm_90a;sm_80;compute_90").

set(HILA_CUDA "AUTO" CACHE STRING "Build the CUDA backend: ON, OFF or AUTO")
set_property(CACHE HILA_CUDA PROPERTY STRINGS ON OFF AUTO)
set(HILA_CUDA_GENCODE
    "-gencode=arch=compute_90a,code=sm_90a;-gencode=arch=compute_80,code=sm_80;-gencode=arch=compute_90,code=compute_90"
    CACHE STRING "nvcc -gencode flags of the CUDA backend")

string(TOUPPER "${HILA_CUDA}" _hila_cuda_req)
if(NOT _hila_cuda_req MATCHES "^(ON|OFF|AUTO|TRUE|FALSE|YES|NO|1|0)$")
  message(FATAL_ERROR "HILA_CUDA: expected ON, OFF or AUTO, got '${HILA_CUDA}'")
endif()
if(_hila_cuda_req MATCHES "^(TRUE|YES|1)$")
  set(_hila_cuda_req ON)
elseif(_hila_cuda_req MATCHES "^(FALSE|NO|0)$")
  set(_hila_cuda_req OFF)
endif()

set(HILA_CUDA_ENABLED OFF)
if(NOT _hila_cuda_req STREQUAL "OFF")
  if(DEFINED CMAKE_CUDA_COMPILER AND NOT CMAKE_CUDA_COMPILER)
    unset(CMAKE_CUDA_COMPILER CACHE)  # an earlier configure found none: look again
  endif()
  if(NOT DEFINED CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX})
    find_program(_hila_nvcc nvcc PATHS ENV CUDA_HOME ENV CUDA_PATH /usr/local/cuda PATH_SUFFIXES bin NO_CACHE)  # after PATH
    if(_hila_nvcc)
      set(ENV{CUDACXX} "${_hila_nvcc}")  # for check_language's trial project
    endif()
  endif()
  include(CheckLanguage)
  check_language(CUDA)  # a trial project: nvcc must compile a program with the host compiler
  if(CMAKE_CUDA_COMPILER)
    set(HILA_CUDA_ENABLED ON)
  elseif(_hila_cuda_req STREQUAL "ON")
    message(FATAL_ERROR
      "hila: HILA_CUDA=ON, but no working CUDA compiler (nvcc) was found on PATH, in $CUDA_HOME/bin, "
      "$CUDA_PATH/bin or /usr/local/cuda/bin. Install the CUDA toolkit (12.x or newer) and put nvcc on "
      "PATH (export PATH=/usr/local/cuda/bin:$PATH), or name it with -DCMAKE_CUDA_COMPILER=/path/to/nvcc "
      "(pip: -C cmake.define.CMAKE_CUDA_COMPILER=/path/to/nvcc); or build the CPU backend only with "
      "HILA_CUDA=OFF. (Why a found nvcc failed: CMakeFiles/CMakeError.log.)")
  endif()
endif()

# The architectures behind the -gencode flags: code=sm_XX (device code), code=compute_XX (PTX).
set(HILA_CUDA_ARCHS "")
if(HILA_CUDA_ENABLED)
  foreach(_flag IN LISTS HILA_CUDA_GENCODE)
    if(_flag MATCHES "code=\\[?([a-z0-9_,]+)\\]?$")
      string(REPLACE "," ";" _codes "${CMAKE_MATCH_1}")
      list(APPEND HILA_CUDA_ARCHS ${_codes})
    endif()
  endforeach()
  list(REMOVE_DUPLICATES HILA_CUDA_ARCHS)
endif()
