# rollbox: the two quick-start targets are `make demo` and `make test`.
# Everything they need is installed here; nothing is assumed to be on the machine.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
APT_PACKAGES := runc erofs-utils debootstrap podman fuse3 iproute2 gcc libc6-dev make \
	python3-venv ca-certificates busybox-static util-linux nftables xfslibs-dev bash-static \
	btrfs-progs qemu-system-x86 qemu-utils lz4 postgresql chromium chromium-driver musl-tools
export ROLLBOX_AGENT := $(CURDIR)/build/rollbox-agent

.PHONY: deps venv native guest vmguest novnc images setup demo lint test test-upstream test-browser bench clean-host
deps: build/.apt-stamp
build/.apt-stamp: Makefile
	mkdir -p build
	@if ! dpkg -s $(APT_PACKAGES) >/dev/null 2>&1; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(APT_PACKAGES); fi
	touch $@

venv: $(BIN)/rollbox
$(BIN)/rollbox: requirements.lock pyproject.toml | deps
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -r requirements.lock
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -e .
	touch $@

native: build/rollbox-agent build/rollbox-jailer build/rollbox-launcher
build/rollbox-agent: native/agent/agent.c | deps
	mkdir -p build
	gcc -static -O2 -Wall -Wextra -o $@ $<

# Starts QEMU jailed for a microVM (backends/microvm/jail.py)
build/rollbox-jailer: native/jailer/jailer.c | deps
	mkdir -p build
	gcc -static -O2 -Wall -Wextra -o $@ $<

# Starts a container sandbox's init: the native runtime (backends/container/launcher.py).
# Linked against musl where musl-gcc is installed (`make deps` installs it; asked when the
# recipe runs, after deps), else glibc: glibc's static start-up probes the CPU with ~70 cpuid
# instructions, each a VM exit on a virtual machine (~7 us here), ~0.5 ms of CPU per sandbox
# the launcher starts; musl's does none. musl brings no kernel headers: the host's linux/ and
# asm/ are linked in build/musl-inc.
MUSL_INC := build/musl-inc
build/rollbox-launcher: native/launcher/launcher.c | deps
	mkdir -p build
	if command -v musl-gcc >/dev/null; then \
		mkdir -p $(MUSL_INC) && \
		ln -sfn /usr/include/linux $(MUSL_INC)/linux && \
		ln -sfn /usr/include/asm-generic $(MUSL_INC)/asm-generic && \
		ln -sfn /usr/include/$$(gcc -dumpmachine)/asm $(MUSL_INC)/asm && \
		musl-gcc -static -O2 -Wall -Wextra -isystem $(MUSL_INC) -o $@ $<; \
	else gcc -static -O2 -Wall -Wextra -o $@ $<; fi

# The microVM guest (src/rollbox/guest/build.py): kernel deb fetched and unpacked (cached by
# version under build/guest/cache), PVH vmlinux, initramfs with the agent as /init, manifest.
# Only the standard library and rollbox's own modules: runs without the venv (worktrees).
GUEST_SOURCES := src/rollbox/guest/build.py src/rollbox/guest/artifacts.py \
	src/rollbox/agent/platform_shell.py
guest: build/guest/manifest.json
build/guest/manifest.json: build/rollbox-agent $(GUEST_SOURCES) | deps
	PYTHONPATH=$(CURDIR)/src $(PY) -m rollbox.guest.build

# The full VM's guest (src/rollbox/guest/vmbuild.py, backends/vm): the generic kernel's bzImage
# (DRM, USB HID) for a SeaBIOS boot, an initramfs like the microVM's with PCI/USB/DRM modules.
vmguest: build/vmguest/manifest.json
build/vmguest/manifest.json: build/rollbox-agent $(GUEST_SOURCES) src/rollbox/guest/vmbuild.py | deps
	PYTHONPATH=$(CURDIR)/src $(PY) -m rollbox.guest.vmbuild

# noVNC for the live view (rollbox.api.liveview serves it): the pinned npm package, fetched with
# npm (its configured registry), its sha512 checked against the integrity pinned here before it
# is unpacked; only its core/ and vendor/ modules and licences are kept (build/novnc).
NOVNC_VERSION := 1.7.0
NOVNC_SHA512 := ucEJOx4T2avIRCleodk7YobZj5O2Ga2AeLfQ69A/yjG9HHba2+PDgwSkN3FttrmG+70ZGx21sElNFouK13RzyA==
novnc: build/novnc/.version
build/novnc/.version: Makefile
	rm -rf build/novnc build/novnc.tmp && mkdir -p build/novnc.tmp
	cd build/novnc.tmp && npm pack --silent --ignore-scripts @novnc/novnc@$(NOVNC_VERSION) >/dev/null
	$(PY) -c 'import base64, hashlib, sys; d = base64.b64encode(hashlib.sha512(open(sys.argv[1], "rb").read()).digest()).decode(); sys.exit(0 if d == sys.argv[2] else "noVNC tarball: sha512 " + d + " is not the pinned " + sys.argv[2])' \
		build/novnc.tmp/novnc-novnc-$(NOVNC_VERSION).tgz '$(NOVNC_SHA512)'
	tar -xzf build/novnc.tmp/novnc-novnc-$(NOVNC_VERSION).tgz -C build/novnc.tmp \
		--no-same-owner --no-same-permissions package/core package/vendor package/LICENSE.txt package/docs
	mv build/novnc.tmp/package build/novnc && rm -rf build/novnc.tmp
	echo $(NOVNC_VERSION) > $@

setup: deps venv native guest vmguest novnc

images: setup
	$(BIN)/rollbox image ensure-defaults

demo: images
	$(BIN)/rollbox demo

# Static checks (pyproject [tool.ruff.lint]: pyflakes' F and syntax errors E9; well under a second).
lint: venv
	$(BIN)/ruff check src tests bench tools

test: images lint
	$(BIN)/python -m pytest -q -rs -p no:cacheprovider tests

bench: images
	$(BIN)/rollbox bench container

# The upstream tier: SWE-ReX's and SandboxFusion's own test suites against a scratch `rollbox serve`
# (tests/upstream; sources from UPSTREAM_SWEREX_SRC / UPSTREAM_SANDBOXFUSION_SRC or GitHub).
test-upstream: images
	$(BIN)/python -m pytest -q -p no:cacheprovider -m upstream tests/upstream

# The browser tier: builds browser:1 (chromium + MiniWoB++; minutes, ~1 GiB), never run by `make test`.
test-browser: images
	$(BIN)/python -m pytest -q -p no:cacheprovider -m browser tests/integration/test_browser.py
