# UCX (Unified Communication X, Debian's libucx-dev) for the step data plane
# (server/ucx/, client/ucx_transport.cc, docs/ucx.md). ATTNSERVE_UCX: AUTO
# (used when pkg-config finds ucx), ON (required) or OFF. Without it both
# binaries still build: the server refuses --ucx_port and the client's
# --transport=auto uses gRPC bytes. Sets ATTNSERVE_HAVE_UCX and, when on, the
# imported target PkgConfig::UCX.
set(ATTNSERVE_UCX "AUTO" CACHE STRING "Build the UCX step transport: AUTO (if pkg-config finds ucx), ON or OFF")
set_property(CACHE ATTNSERVE_UCX PROPERTY STRINGS AUTO ON OFF)

set(ATTNSERVE_HAVE_UCX OFF)
# A static attnserve cannot use UCX's transport modules (they are shared
# objects UCX dlopen()s, linked against libuct.so): AUTO leaves UCX out there.
if(ATTNSERVE_STATIC AND ATTNSERVE_UCX STREQUAL "AUTO")
  message(STATUS "attnserve: static build; the UCX step transport is left out (ATTNSERVE_UCX=ON to force)")
elseif(NOT ATTNSERVE_UCX STREQUAL "OFF")
  find_package(PkgConfig QUIET)
  if(PkgConfig_FOUND)
    pkg_check_modules(UCX QUIET IMPORTED_TARGET ucx)
  endif()
  if(UCX_FOUND)
    set(ATTNSERVE_HAVE_UCX ON)
    message(STATUS "attnserve: UCX ${UCX_VERSION} found; the UCX step transport is built")
  elseif(ATTNSERVE_UCX STREQUAL "ON")
    message(FATAL_ERROR "ATTNSERVE_UCX=ON but pkg-config finds no ucx (apt-get install libucx-dev)")
  else()
    message(STATUS "attnserve: no UCX (pkg-config ucx); the UCX step transport is left out")
  endif()
endif()
