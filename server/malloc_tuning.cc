// Empty: the allocator settings live in common/malloc_tuning.cc. Goes with
// its line in server/CMakeLists.txt.
