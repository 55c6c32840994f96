// What a shared-memory client may leave behind, for the tests that check it
// leaves nothing: POSIX shm objects still in /dev/shm under a key prefix, and
// regions still registered with the server (SharedMemory.Status).
#pragma once

#include <dirent.h>
#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "attnserve/v1/shm.grpc.pb.h"
#include "common/grpc_status.h"

namespace attnserve {

// The objects in /dev/shm whose shm_open name ("/" + file name) starts with
// `key_prefix`.
inline std::vector<std::string> ShmObjectsUnder(const std::string& key_prefix) {
  std::vector<std::string> found;
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return found;
  while (const dirent* e = readdir(dir)) {
    const std::string key = std::string("/") + e->d_name;
    if (absl::StartsWith(key, key_prefix)) found.push_back(key);
  }
  closedir(dir);
  return found;
}

// The names of the regions the server at `target` lists for the caller.
inline absl::StatusOr<std::vector<std::string>> RegisteredRegions(const std::string& target) {
  auto stub =
      v1::SharedMemory::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  v1::RegionStatusResponse response;
  const grpc::Status status = stub->Status(&context, v1::RegionStatusRequest(), &response);
  if (!status.ok()) return ToAbslStatus(status);
  std::vector<std::string> names;
  for (const v1::RegionStatus& r : response.regions()) names.push_back(r.name());
  return names;
}

}  // namespace attnserve
