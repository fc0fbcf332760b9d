#!/usr/bin/env bash
# Builds oneTBB with -fsanitize=thread into PREFIX, from Debian's own source package for the
# installed libtbb-dev (same version, same patches). Debian's libtbb is not instrumented, so
# TSan would report false races on data handed between TBB tasks; the TSan build links this
# instead. Cached: does nothing when PREFIX already holds this version.
#   usage: scripts/build-tsan-tbb.sh PREFIX
set -euo pipefail
prefix=$(realpath -m "${1:?usage: $0 PREFIX}")
version=$(dpkg-query -W -f='${source:Version}' libtbb-dev)
if [[ -f "$prefix/.version" && $(cat "$prefix/.version") == "$version" ]]; then
  exit 0
fi

work="$prefix.work"
rm -rf "$work" && mkdir -p "$work/lists/partial"
cd "$work"

# A private deb-src list for the machine's own Debian mirror; the system's apt state is untouched.
mirror=$({
  grep -h -E '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}'
  grep -h -E '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null | awk '{print $2}'
} | grep debian | grep -v security | head -n 1 || true)
mirror=${mirror:-http://deb.debian.org/debian}
codename=$(. /etc/os-release && echo "$VERSION_CODENAME")
cat >src.list <<LIST
deb-src $mirror $codename main
deb-src $mirror $codename-updates main
deb-src ${mirror%/debian}/debian-security $codename-security main
LIST
apt_opts=(-o "Dir::Etc::SourceList=$work/src.list" -o Dir::Etc::SourceParts=/dev/null
  -o "Dir::State::Lists=$work/lists" -o APT::Sandbox::User=root -q)
apt-get "${apt_opts[@]}" update >/dev/null
apt-get "${apt_opts[@]}" source --download-only "onetbb=$version" >/dev/null
dpkg-source -x --no-check onetbb_*.dsc src >/dev/null

cmake -S src -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTBB_SANITIZE=thread -DTBB_TEST=OFF \
  -DTBB_EXAMPLES=OFF -DTBB_STRICT=OFF -DTBBMALLOC_BUILD=OFF -DTBB4PY_BUILD=OFF \
  -DCMAKE_INSTALL_PREFIX="$prefix" >/dev/null
cmake --build build -j"$(nproc)" >build.log 2>&1 || { tail -n 40 build.log; exit 1; }
cmake --install build >/dev/null
echo "$version" >"$prefix/.version"
cd / && rm -rf "$work"
echo "build-tsan-tbb: oneTBB $version with -fsanitize=thread in $prefix"
