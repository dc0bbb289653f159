# SPDX-License-Identifier: Apache-2.0
# hila/version.h (public, installed) and hila::build_info() (src/core/build_info.cpp.in), both
# generated into the build tree from the configure step's facts.

configure_file(${PROJECT_SOURCE_DIR}/cmake/version.h.in ${PROJECT_BINARY_DIR}/include/hila/version.h @ONLY)
target_include_directories(hila PUBLIC $<BUILD_INTERFACE:${PROJECT_BINARY_DIR}/include>)

set(HILA_BUILD_CUDA_VERSION "")
set(HILA_BUILD_CUDA_ARCHS "")
set(HILA_BUILD_CUDA_GENCODE "")
if(HILA_CUDA_ENABLED)
  set(HILA_BUILD_CUDA_VERSION "${CUDAToolkit_VERSION}")
  list(JOIN HILA_CUDA_ARCHS "\", \"" HILA_BUILD_CUDA_ARCHS)
  set(HILA_BUILD_CUDA_ARCHS "\"${HILA_BUILD_CUDA_ARCHS}\"")
  list(JOIN HILA_CUDA_GENCODE " " HILA_BUILD_CUDA_GENCODE)
endif()
set(_hila_build_info ${PROJECT_BINARY_DIR}/src/core/build_info.cpp)
configure_file(${PROJECT_SOURCE_DIR}/src/core/build_info.cpp.in ${_hila_build_info} @ONLY)
target_sources(hila PRIVATE ${_hila_build_info})
set_source_files_properties(${_hila_build_info} PROPERTIES COMPILE_DEFINITIONS "HILA_BUILD_TYPE=\"$<CONFIG>\"")
