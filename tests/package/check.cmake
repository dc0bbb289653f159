# SPDX-License-Identifier: Apache-2.0
# The package tests (registered in tests/CMakeLists.txt), run as
#   cmake -DMODE=<mode> -DHILA_SOURCE_DIR=.. -DHILA_BINARY_DIR=.. -DWORK=.. -DHILA_VERSION=..
#         -DCXX=<C++ compiler> -DCONFIG=<build type> -P check.cmake
# MODE install           cmake --install the build tree into WORK/prefix
#      find_package      configure, build and run this directory's consumer against WORK/prefix
#      pkg_config        compile and link main.cpp with `pkg-config --cflags --libs hila` only
#      add_subdirectory  the consumer with hila's source tree as a subproject (CPU backend only:
#                        this checks options and dependencies; the CUDA sources are checked by the
#                        main build)
cmake_minimum_required(VERSION 3.24)
set(_here ${CMAKE_CURRENT_LIST_DIR})
set(_prefix ${WORK}/prefix)
set(_config "")
if(CONFIG)
  set(_config --config ${CONFIG})
endif()

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    list(JOIN ARGN " " cmd)
    message(FATAL_ERROR "package test (${MODE}) failed (${rc}): ${cmd}")
  endif()
endfunction()

if(MODE STREQUAL "install")
  file(REMOVE_RECURSE ${_prefix})
  run(${CMAKE_COMMAND} --install ${HILA_BINARY_DIR} --prefix ${_prefix} ${_config})
  file(GLOB_RECURSE _cfg ${_prefix}/*/hilaConfig.cmake)
  file(GLOB_RECURSE _pc ${_prefix}/*/hila.pc)
  if(NOT _cfg OR NOT _pc OR NOT EXISTS ${_prefix}/include/hila/version.h)
    message(FATAL_ERROR "package test (install): missing hilaConfig.cmake, hila.pc or hila/version.h under ${_prefix}")
  endif()
elseif(MODE STREQUAL "find_package")
  set(_b ${WORK}/find_package)
  file(REMOVE_RECURSE ${_b})
  run(${CMAKE_COMMAND} -S ${_here} -B ${_b} -DCMAKE_PREFIX_PATH=${_prefix} -DCMAKE_CXX_COMPILER=${CXX}
      -DCMAKE_BUILD_TYPE=${CONFIG} -DHILA_VERSION_WANTED=${HILA_VERSION})
  run(${CMAKE_COMMAND} --build ${_b} ${_config})
  file(GLOB_RECURSE _exe ${_b}/consumer ${_b}/consumer.exe)
  run(${_exe})
elseif(MODE STREQUAL "pkg_config")
  find_program(_pkgconfig NAMES pkg-config pkgconf REQUIRED)
  file(GLOB_RECURSE _pc ${_prefix}/*/hila.pc)
  get_filename_component(_pcdir "${_pc}" DIRECTORY)
  set(ENV{PKG_CONFIG_PATH} "${_pcdir}")
  execute_process(COMMAND ${_pkgconfig} --modversion hila OUTPUT_VARIABLE _ver OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT _ver STREQUAL HILA_VERSION)
    message(FATAL_ERROR "package test (pkg_config): pkg-config --modversion hila gave '${_ver}', expected ${HILA_VERSION}")
  endif()
  foreach(_what cflags libs)
    execute_process(COMMAND ${_pkgconfig} --${_what} hila OUTPUT_VARIABLE _${_what}
                    OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE rc)
    if(NOT rc EQUAL 0)
      message(FATAL_ERROR "package test (pkg_config): pkg-config --${_what} hila failed")
    endif()
    message(STATUS "pkg-config --${_what} hila: ${_${_what}}")
    separate_arguments(_${_what} UNIX_COMMAND "${_${_what}}")
  endforeach()
  file(MAKE_DIRECTORY ${WORK}/pkg_config)
  # Compile with the public headers' language and hila.pc's Cflags only (no OpenMP flag), then
  # link with its Libs, as a Makefile would.
  run(${CXX} -std=c++17 -O1 ${_cflags} -c ${_here}/main.cpp -o ${WORK}/pkg_config/main.o)
  run(${CXX} ${WORK}/pkg_config/main.o ${_libs} -o ${WORK}/pkg_config/consumer)
  run(${WORK}/pkg_config/consumer)
elseif(MODE STREQUAL "add_subdirectory")
  set(_b ${WORK}/add_subdirectory)
  file(REMOVE_RECURSE ${_b})
  run(${CMAKE_COMMAND} -S ${_here} -B ${_b} -DHILA_SOURCE_DIR=${HILA_SOURCE_DIR} -DHILA_CUDA=OFF
      -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_BUILD_TYPE=${CONFIG})
  include(ProcessorCount)
  ProcessorCount(_jobs)
  run(${CMAKE_COMMAND} --build ${_b} ${_config} --parallel ${_jobs})
  file(GLOB_RECURSE _exe ${_b}/consumer ${_b}/consumer.exe)
  run(${_exe})
else()
  message(FATAL_ERROR "check.cmake: MODE must be install, find_package, pkg_config or add_subdirectory, got '${MODE}'")
endif()
