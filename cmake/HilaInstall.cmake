# SPDX-License-Identifier: Apache-2.0
# `cmake --install`: libhila.a, the public headers with the generated hila/version.h, the CMake
# package (find_package(hila) -> hila::hila), the pkg-config file hila.pc and the CLI.
#
#   lib/libhila.a  include/hila/*.h  lib/cmake/hila/hila{Config,ConfigVersion,Targets}.cmake
#   lib/pkgconfig/hila.pc  bin/hila
#
# hila::hila carries what linking the static library needs: the OpenMP runtime (link-only; no
# -fopenmp on the consumer's compile lines) and, with the CUDA backend, the static CUDA runtime.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(HILA_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/hila" CACHE STRING
    "Where the CMake package files of hila are installed (relative to the prefix)")

install(TARGETS hila EXPORT hilaTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/hila DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(FILES ${PROJECT_BINARY_DIR}/include/hila/version.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/hila)
install(EXPORT hilaTargets NAMESPACE hila:: DESTINATION ${HILA_INSTALL_CMAKEDIR})

# The CUDA toolkit hila was built with (its objects need that CUDA runtime or a newer one): the
# config's CUDAToolkit_ROOT unless the consumer sets CUDAToolkit_ROOT or CUDA_PATH.
set(HILA_CUDA_TOOLKIT_ROOT "")
if(HILA_CUDA_ENABLED)
  get_filename_component(HILA_CUDA_TOOLKIT_ROOT "${CUDAToolkit_BIN_DIR}" DIRECTORY)
endif()
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/hilaConfig.cmake.in
  ${PROJECT_BINARY_DIR}/hilaConfig.cmake INSTALL_DESTINATION ${HILA_INSTALL_CMAKEDIR})
# 0.x: a minor version may change the API, so only the same MAJOR.MINOR is compatible.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/hilaConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/hilaConfig.cmake ${PROJECT_BINARY_DIR}/hilaConfigVersion.cmake
  DESTINATION ${HILA_INSTALL_CMAKEDIR})

# hila.pc, relocatable: prefix is found from the .pc file's own directory.
set(_hila_pc_dir "${CMAKE_INSTALL_LIBDIR}/pkgconfig")
if(IS_ABSOLUTE "${CMAKE_INSTALL_LIBDIR}")
  set(HILA_PC_PREFIX "${CMAKE_INSTALL_PREFIX}")
else()
  file(RELATIVE_PATH _hila_pc_up "/${_hila_pc_dir}" "/")
  string(REGEX REPLACE "/$" "" _hila_pc_up "${_hila_pc_up}")
  set(HILA_PC_PREFIX "\${pcfiledir}/${_hila_pc_up}")
endif()
set(HILA_PC_LIBS "${OpenMP_CXX_FLAGS}")
set(HILA_PC_CFLAGS "")
if(HILA_CUDA_ENABLED)
  string(APPEND HILA_PC_LIBS " -L${CUDAToolkit_LIBRARY_DIR} -lcudart_static -ldl -lrt -lpthread")
  string(APPEND HILA_PC_CFLAGS " -DHILA_WITH_CUDA=1")
endif()
configure_file(${PROJECT_SOURCE_DIR}/cmake/hila.pc.in ${PROJECT_BINARY_DIR}/hila.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/hila.pc DESTINATION ${_hila_pc_dir})

if(TARGET hila_cli)
  install(TARGETS hila_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()
