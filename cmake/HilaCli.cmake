# SPDX-License-Identifier: Apache-2.0
# Whether the hila CLI (tools/) is built: HILA_BUILD_CLI = ON (CLI11 and nlohmann_json are required),
# OFF, or AUTO (built when both are found; the Python package builds it this way for its `hila`
# console script). Sets HILA_CLI_ENABLED.

string(TOUPPER "${HILA_BUILD_CLI}" _hila_cli_req)
if(_hila_cli_req MATCHES "^(TRUE|YES|1)$")
  set(_hila_cli_req ON)
elseif(_hila_cli_req MATCHES "^(FALSE|NO|0|)$")
  set(_hila_cli_req OFF)
endif()
if(NOT _hila_cli_req MATCHES "^(ON|OFF|AUTO)$")
  message(FATAL_ERROR "HILA_BUILD_CLI: expected ON, OFF or AUTO, got '${HILA_BUILD_CLI}'")
endif()

set(HILA_CLI_ENABLED OFF)
if(NOT _hila_cli_req STREQUAL "OFF")
  find_package(nlohmann_json 3.10 QUIET)
  find_package(CLI11 QUIET)
  if(nlohmann_json_FOUND AND CLI11_FOUND)
    set(HILA_CLI_ENABLED ON)
  else()
    set(_hila_found_cli11 no)
    set(_hila_found_json no)
    if(CLI11_FOUND)
      set(_hila_found_cli11 yes)
    endif()
    if(nlohmann_json_FOUND)
      set(_hila_found_json yes)
    endif()
    string(CONCAT _hila_cli_why
      "the hila CLI needs CLI11 and nlohmann_json >= 3.10 (found: CLI11 ${_hila_found_cli11}, "
      "nlohmann_json ${_hila_found_json}); install them with `bash scripts/setup.sh` or "
      "`apt-get install libcli11-dev nlohmann-json3-dev`, or point CMAKE_PREFIX_PATH at them")
    if(_hila_cli_req STREQUAL "ON")
      message(FATAL_ERROR "hila: HILA_BUILD_CLI=ON, but ${_hila_cli_why}; or configure with -DHILA_BUILD_CLI=OFF.")
    endif()
    message(WARNING "hila: the CLI is not built (HILA_BUILD_CLI=AUTO): ${_hila_cli_why}.")
  endif()
endif()
