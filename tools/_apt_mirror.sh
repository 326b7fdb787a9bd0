# Sourced by tools/fetch_cuda12.sh and tools/make_sysroot.sh: the Debian archive this machine's own apt
# configuration fetches from (its first "debian" source that is not the security archive), so that no mirror is
# named in the repository. DEBIAN_MIRROR overrides it.
debian_mirror() {
  if [[ -n "${DEBIAN_MIRROR:-}" ]]; then echo "$DEBIAN_MIRROR"; return; fi
  local uri
  uri=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null \
        | sed -nE 's/^[[:space:]]*URIs:[[:space:]]*//p; s/^[[:space:]]*deb[[:space:]]+(\[[^]]*\][[:space:]]+)?([^[:space:]]+).*/\2/p' \
        | tr ' ' '\n' | grep -E '/debian/?$' | head -n 1 || true)
  if [[ -z "$uri" ]]; then
    echo "no Debian archive in this machine's apt sources; set DEBIAN_MIRROR to one" >&2
    return 1
  fi
  echo "${uri%/}"
}
