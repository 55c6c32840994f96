// ATTNSERVE_OWN_ALLOCATOR: defined when a sanitizer replaces glibc's malloc
// (ASan keeps freed memory in quarantine, TSan has its own allocator), so
// tests of glibc's behaviour (RSS, arenas, mallinfo2) skip themselves.
#pragma once

#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define ATTNSERVE_OWN_ALLOCATOR 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define ATTNSERVE_OWN_ALLOCATOR 1
#endif
