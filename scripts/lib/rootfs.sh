# Root filesystems for Rekindle's images, made without a registry: a Debian
# base from debootstrap and Python envs pip-installed inside a chroot of it, so
# the env's interpreter is the image's own python3. Source after common.sh.

ROOTFS_SUITE=${ROOTFS_SUITE:-bookworm}
# What chroot_venv's output is made of beyond its inputs; images built on a venv
# put it in their cache keys, so a change here rebuilds them.
VENV_FORMAT=pyc-unchecked-hash

# debian_base KEYDIR_PREFIX PKG...: a cached minbase rootfs with PKGs; prints its path.
debian_base() {
	local prefix=$1 key dir mirror
	shift
	key=$(printf '%s\n' "$ROOTFS_SUITE" "$@" | sha256sum | cut -c1-12)
	dir=$prefix-$key
	if [ ! -f "$dir.done" ]; then
		apt_install debootstrap
		log "debootstrap $ROOTFS_SUITE into $dir (first time only)"
		rm -rf "$dir"
		mirror=$(sed -n 's/^URIs: *\(http[^ ]*debian\/*\)$/\1/p; s/^deb \(http[^ ]*debian\/*\) .*/\1/p' \
			/etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null | head -1)
		[ -n "$mirror" ] || die "no Debian mirror found in /etc/apt sources; debootstrap needs one"
		debootstrap --variant=minbase --include="$(
			IFS=,
			echo "$*"
		)" "$ROOTFS_SUITE" "$dir" "$mirror" >&2
		rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/*
		touch "$dir.done"
	fi
	echo "$dir"
}

# chroot_venv BASE OUTDIR VENV_PATH SCRIPT: run SCRIPT (sh) in a throwaway copy of
# BASE after creating a venv at VENV_PATH, then keep only the venv as OUTDIR/venv,
# byte-compiled (compile_venv).
# pip's cache is shared with the host; pip trusts the build host's CA bundle.
chroot_venv() {
	local base=$1 out=$2 venv_path=$3 script=$4
	[ -f "$out.done" ] || pip_in_chroot "$base" "$out" "$venv_path" "$script"
	[ -f "$out.compiled" ] || compile_venv "$base" "$out" "$venv_path"
}

pip_in_chroot() {
	local base=$1 out=$2 venv_path=$3 script=$4 root rc=0
	root=$out.chroot
	rm -rf "$root" "$out"
	cp -a "$base" "$root"
	mkdir -p "$root/root/.cache/pip" "$HOME/.cache/pip" "$root/src"
	cp /etc/resolv.conf "$root/etc/resolv.conf"
	cp "${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}" "$root/tmp/build-host-ca.crt"
	mount --bind /proc "$root/proc"
	mount --bind "$HOME/.cache/pip" "$root/root/.cache/pip"
	chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
		PIP_CERT=/tmp/build-host-ca.crt PIP_DEFAULT_TIMEOUT=180 PIP_DISABLE_PIP_VERSION_CHECK=1 \
		/bin/sh -ec "python3 -m venv $venv_path; $script" >&2 || rc=$?
	umount "$root/root/.cache/pip" "$root/proc"
	[ $rc = 0 ] || die "pip install inside the image's root filesystem failed (see above)"
	mkdir -p "$out"
	mv "$root$venv_path" "$out/venv"
	find "$out/venv" -name __pycache__ -prune -exec rm -rf {} +
	rm -rf "$root"
	touch "$out.done"
}

# compile_venv BASE OUTDIR VENV_PATH: byte-compile OUTDIR/venv once, with the image's
# own python3, into hash-based pycs that are never checked against their source.
# Pods run as a user who cannot write __pycache__ beside root-owned sources, so
# without them every process of every pod compiles vLLM, torch and transformers
# from source again: about half of each import, four imports per vLLM boot. An
# image's files never change, so the check against the source is skipped as well.
compile_venv() {
	local base=$1 out=$2 venv_path=$3 site rc=0
	log "byte-compiling $out/venv (first time only)"
	# Some packages ship files that are not Python 3 (templates, test data): compileall
	# reports them and exits 1; what matters is checked below.
	venv_chroot "$base" "python3 -m compileall -qq -j 0 --invalidation-mode unchecked-hash $venv_path/lib" \
		"$out/venv:$venv_path" || rc=$?
	site=$(find "$out/venv/lib" -maxdepth 2 -name site-packages -type d)
	compgen -G "$site/pip/__pycache__/__init__.cpython-*.pyc" >/dev/null ||
		die "byte-compiling $out/venv failed (compileall exit $rc)"
	touch "$out.compiled"
}

# venv_chroot BASE SCRIPT HOSTDIR:PATH...: run SCRIPT (sh) as root in a throwaway copy
# of BASE with each HOSTDIR bind-mounted (read-write) at PATH; SCRIPT's exit status.
venv_chroot() {
	local base=$1 script=$2 root bind rc=0
	shift 2
	root=$(mktemp -d "${TMPDIR:-/var/tmp}/rekindle-chroot.XXXXXX")
	cp -a "$base/." "$root"
	mount --bind /proc "$root/proc"
	for bind in "$@"; do
		mkdir -p "$root${bind#*:}"
		mount --bind "${bind%%:*}" "$root${bind#*:}"
	done
	chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
		/bin/sh -ec "$script" >&2 || rc=$?
	for bind in "$@"; do
		umount "$root${bind#*:}" || die "cannot unmount $root${bind#*:}: remove $root by hand"
	done
	umount "$root/proc" || die "cannot unmount $root/proc: remove $root by hand"
	rm -rf "$root"
	return $rc
}

# project_deps [EXTRA...]: the project's dependencies (and extras') from pyproject.toml, shell-quoted.
project_deps() {
	python3 - "$REKINDLE_ROOT/pyproject.toml" "$@" <<'PY'
import shlex, sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))["project"]
deps = list(p["dependencies"])
for extra in sys.argv[2:]:
    deps += p["optional-dependencies"][extra]
print(" ".join(shlex.quote(d) for d in deps))
PY
}

# install_requirements OUTDIR VENV_PATH FILE: the requirements FILE lists, installed
# into VENV_PATH of an image, laid out under OUTDIR (beside install_project's wheel).
install_requirements() {
	local deps_venv
	deps_venv=$("$REKINDLE_ROOT/scripts/python-env" --deps-path)
	"$deps_venv/bin/python" -m pip install -q --disable-pip-version-check --no-compile \
		--ignore-installed --root "$1" --prefix "$2" -r "$3" >&2
}

# install_project OUTDIR VENV_PATH PACKAGE...: the project, installed as a wheel
# into VENV_PATH of an image, laid out under OUTDIR (a layer for "/"), with only
# the import packages named (the operator image ships no agent, neither image
# ships rekindle_dev). Console scripts get the image venv's interpreter.
install_project() {
	local out=$1 venv_path=$2 deps_venv wheels site keep p
	shift 2
	"$REKINDLE_ROOT/scripts/python-env" >/dev/null
	deps_venv=$("$REKINDLE_ROOT/scripts/python-env" --deps-path)
	wheels=$(mktemp -d)
	rm -rf "$out"
	mkdir -p "$out"
	(cd "$REKINDLE_ROOT" && "$deps_venv/bin/python" -m pip wheel -q --no-deps --no-build-isolation \
		-w "$wheels" . >&2)
	rm -rf "$REKINDLE_ROOT/build"
	"$deps_venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-compile \
		--root "$out" --prefix "$venv_path" "$wheels"/rekindle_vllm-*.whl >&2
	rm -rf "$wheels"
	site=$(find "$out$venv_path/lib" -maxdepth 2 -name site-packages -type d)
	keep=" $* "
	for p in "$site"/rekindle_*/; do
		p=$(basename "$p")
		[[ $p == *.dist-info ]] && continue # the distribution's metadata (its version)
		[[ $keep == *" $p "* ]] || rm -rf "${site:?}/$p"
	done
	[[ $keep == *" rekindle_dev "* ]] || rm -f "$out$venv_path/bin/rekindle-dev"
	[[ $keep == *" rekindle_agent "* ]] || rm -f "$out$venv_path/bin/rekindle"
	[[ $keep == *" rekindle_node "* ]] || rm -f "$out$venv_path/bin/rekindle-node"
	[[ $keep == *" rekindle_operator "* ]] || rm -f "$out$venv_path/bin/kubectl-rekindle"
	sed -i "1s|^#!.*python.*$|#!$venv_path/bin/python|" "$out$venv_path"/bin/*
	# Same source, same bytes: the image is keyed by this layer's content.
	rm -f "$site"/rekindle_vllm-*.dist-info/direct_url.json
	find "$out" -name __pycache__ -prune -exec rm -rf {} +
}
