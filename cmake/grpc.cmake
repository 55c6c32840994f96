# gRPC, Protobuf and spdlog for the server and client (Debian 12 packages).
find_package(Protobuf REQUIRED)
find_package(gRPC CONFIG REQUIRED)
# spdlog/fmt are used header-only: Debian ships no static archives for them.
find_package(spdlog CONFIG REQUIRED)
if(TARGET spdlog::spdlog_header_only)
  set(ATTNSERVE_SPDLOG spdlog::spdlog_header_only)
else()
  set(ATTNSERVE_SPDLOG spdlog::spdlog)
endif()
