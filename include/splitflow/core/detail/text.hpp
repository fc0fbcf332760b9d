// Text for the exporters: names and messages may hold any bytes, and the formats take UTF-8.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <string_view>

namespace splitflow::detail {

/// `s` with each ill-formed part replaced by one U+FFFD, as the JSON summary writes them (its
/// JSON library's decoder): the longest start of a well-formed sequence that breaks off (a
/// truncated sequence) is one part, and a byte that cannot begin one (a stray continuation byte,
/// C0, C1, F5-FF) another. Overlong forms, surrogates and code points past U+10FFFF break off at
/// their second byte (Unicode's "maximal subpart" practice).
inline std::string valid_utf8(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  const auto byte = [&](std::size_t i) { return static_cast<unsigned char>(s[i]); };
  for (std::size_t i = 0; i < s.size();) {
    const unsigned char c = byte(i);
    std::size_t n = 0;                  // the sequence's length (0: c cannot begin one)
    unsigned char lo = 0x80, hi = 0xBF;  // the range of its second byte
    if (c < 0x80) n = 1;
    else if (c >= 0xC2 && c <= 0xDF) n = 2;
    else if (c >= 0xE0 && c <= 0xEF) n = 3, lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
    else if (c >= 0xF0 && c <= 0xF4) n = 4, lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
    std::size_t k = n == 0 ? 0 : 1;  // bytes of it that are well-formed so far
    while (k > 0 && k < n && i + k < s.size()) {
      const unsigned char b = byte(i + k);
      if (k == 1 ? (b < lo || b > hi) : (b & 0xC0) != 0x80) break;
      ++k;
    }
    if (n != 0 && k == n) {
      out.append(s.substr(i, n));
    } else {
      out += "\xEF\xBF\xBD";
    }
    i += std::max<std::size_t>(k, 1);
  }
  return out;
}

/// A Prometheus label value: UTF-8 (valid_utf8), with backslash, quote and newline escaped.
inline std::string prometheus_label(std::string_view s) {
  std::string out;
  for (char c : valid_utf8(s)) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

}  // namespace splitflow::detail
