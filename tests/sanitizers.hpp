// Which sanitizer a test binary is built with, for GCC (__SANITIZE_ADDRESS__,
// __SANITIZE_THREAD__) and Clang (__has_feature; the ASan+UBSan suite is built with clang 16).
#pragma once

#if defined(__SANITIZE_ADDRESS__)
#define SPLITFLOW_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SPLITFLOW_TEST_ASAN 1
#endif
#endif

#if defined(__SANITIZE_THREAD__)
#define SPLITFLOW_TEST_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define SPLITFLOW_TEST_TSAN 1
#endif
#endif
