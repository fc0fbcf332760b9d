// The host bytes an item holds: what the tuner's memory budget (RuntimeConfig::host_memory_budget)
// counts per queued item, and StageStats::item_bytes reports. An estimate: the item itself
// (sizeof) and what it owns on the heap, found by structure for the standard containers and
// through a customisation point for the rest.
//
//     namespace app {
//     struct Frame { std::vector<float> pixels; int id; };
//     // A struct of the user's counts as its sizeof unless it says what it holds:
//     std::size_t host_bytes(const Frame& f) { return sizeof f + f.pixels.capacity() * sizeof(float); }
//     }
//     splitflow::bytes_of(std::vector<int>(10));                    // sizeof(vector) + 40
//     splitflow::bytes_of(app::Frame{std::vector<float>(256), 1});  // sizeof(Frame) + 1024
//
// A type says how much it holds by either of (the first found is used):
//  - a member `std::size_t host_bytes() const`, or
//  - a function `std::size_t host_bytes(const T&)` in T's namespace (argument-dependent lookup),
// each returning its whole size (sizeof included). Otherwise: std::string, std::vector,
// std::array, std::pair, std::tuple, std::optional, std::variant, std::unique_ptr and
// std::shared_ptr (the pointee counted for each holder) are counted by their contents; any other
// type by its sizeof. A HostTensor counts its bytes (tensor.hpp); a DeviceTensor only its handle
// (its memory is the device's).
#pragma once

#include <array>
#include <concepts>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace splitflow {

template <class T>
std::size_t bytes_of(const T& item);

namespace bytes_detail {

template <class T>
concept HasMember = requires(const T& t) {
  { t.host_bytes() } -> std::convertible_to<std::size_t>;
};
template <class T>
concept HasAdl = requires(const T& t) {
  { host_bytes(t) } -> std::convertible_to<std::size_t>;
};

template <class T>
struct is_vector : std::false_type {};
template <class U, class A>
struct is_vector<std::vector<U, A>> : std::true_type {};
template <class T>
struct is_array : std::false_type {};
template <class U, std::size_t N>
struct is_array<std::array<U, N>> : std::true_type {};
template <class T>
struct is_pair : std::false_type {};
template <class A, class B>
struct is_pair<std::pair<A, B>> : std::true_type {};
template <class T>
struct is_tuple : std::false_type {};
template <class... U>
struct is_tuple<std::tuple<U...>> : std::true_type {};
template <class T>
struct is_optional : std::false_type {};
template <class U>
struct is_optional<std::optional<U>> : std::true_type {};
template <class T>
struct is_variant : std::false_type {};
template <class... U>
struct is_variant<std::variant<U...>> : std::true_type {};
template <class T>
struct is_pointer : std::false_type {};
template <class U, class D>
struct is_pointer<std::unique_ptr<U, D>> : std::true_type {};
template <class U>
struct is_pointer<std::shared_ptr<U>> : std::true_type {};

/// Bytes `item` holds beyond its own sizeof (what it owns elsewhere).
template <class T>
std::size_t owned(const T& item) {
  if constexpr (HasMember<T> || HasAdl<T>) {
    const std::size_t all = bytes_of(item);
    return all > sizeof(T) ? all - sizeof(T) : 0;
  } else if constexpr (std::is_same_v<T, std::string>) {
    // (A short string lives in the object: no heap block.)
    return item.capacity() >= sizeof(T) ? item.capacity() + 1 : 0;
  } else if constexpr (is_vector<T>::value) {
    using U = typename T::value_type;
    std::size_t n = item.capacity() * sizeof(U);
    // (Trivially copyable elements own nothing, unless they say so.)
    if constexpr (!std::is_trivially_copyable_v<U> || HasMember<U> || HasAdl<U>)
      for (const U& u : item) n += owned(u);
    return n;
  } else if constexpr (is_array<T>::value) {
    std::size_t n = 0;
    for (const auto& u : item) n += owned(u);
    return n;
  } else if constexpr (is_pair<T>::value) {
    return owned(item.first) + owned(item.second);
  } else if constexpr (is_tuple<T>::value) {
    return std::apply([](const auto&... u) { return (std::size_t{0} + ... + owned(u)); }, item);
  } else if constexpr (is_optional<T>::value) {
    return item ? owned(*item) : 0;
  } else if constexpr (is_variant<T>::value) {
    return item.valueless_by_exception() ? 0 : std::visit([](const auto& u) { return owned(u); }, item);
  } else if constexpr (is_pointer<T>::value) {
    using U = typename T::element_type;
    if constexpr (std::is_object_v<U> && !std::is_array_v<U>) return item ? bytes_of(*item) : 0;
    else return 0;
  } else {
    return 0;
  }
}

}  // namespace bytes_detail

/// The host bytes `item` holds: itself and what it owns (the rules above). Cheap for flat items;
/// a container of containers is walked, so the executor samples it (every 8th delivery into a
/// queue) rather than measuring every item.
template <class T>
std::size_t bytes_of(const T& item) {
  if constexpr (bytes_detail::HasMember<T>) {
    return static_cast<std::size_t>(item.host_bytes());
  } else if constexpr (bytes_detail::HasAdl<T>) {
    return static_cast<std::size_t>(host_bytes(item));
  } else {
    return sizeof(T) + bytes_detail::owned(item);
  }
}

}  // namespace splitflow
