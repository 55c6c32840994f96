// Runs the built attnctl binary (ATTNCTL_BINARY, set by CMake) as a child
// process and captures its exit code, stdout and stderr: shared by the CLI
// tests.
#pragma once

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

#ifndef ATTNCTL_BINARY
#error "ATTNCTL_BINARY must name the attnctl executable"
#endif

namespace attnserve {

struct CliResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Runs attnctl with `args`, stdout and stderr captured through files (no
// shell, so arguments need no quoting).
inline CliResult RunCli(const std::vector<std::string>& args) {
  static int counter = 0;
  const std::string base =
      absl::StrCat(::testing::TempDir(), "/attnctl_", getpid(), "_", ++counter);
  const std::string out_path = base + ".out", err_path = base + ".err";
  std::vector<std::string> all = {ATTNCTL_BINARY};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);

  CliResult r;
  const pid_t pid = fork();
  if (pid == 0) {
    const int out = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    const int err = open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    dup2(out, 1);
    dup2(err, 2);
    execv(argv[0], argv.data());
    _exit(127);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = ReadFile(out_path);
  r.err = ReadFile(err_path);
  std::remove(out_path.c_str());
  std::remove(err_path.c_str());
  return r;
}

inline std::string Describe(const CliResult& r) {
  return absl::StrCat("exit ", r.exit_code, "\n--- stdout\n", r.out, "--- stderr\n", r.err);
}

}  // namespace attnserve
