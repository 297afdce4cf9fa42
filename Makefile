# lockcell: the two commands are `make dev` and `make test`; each sets itself up.
CARGO ?= cargo
DEV_DIR ?= .lockcell-dev

.PHONY: setup build dev test lint fmt clean bench bench-full chaos api-doc config-doc image

setup:
	@sh deploy/setup.sh

build: setup
	$(CARGO) build --workspace --bins

# A local three-zone cell: 3 etcd members, 3 proxies. Ctrl-C stops everything.
dev: build
	./target/debug/lockcell-dev --dir $(DEV_DIR)

# Unit tests, then the end-to-end tests against real etcd and proxy processes (one
# at a time: they measure nothing, but short TTLs want the two cores to themselves).
test: build
	$(CARGO) test --workspace --exclude lockcell-tests
	$(CARGO) test -p lockcell-tests --lib --bins
	$(CARGO) test -p lockcell-tests --test deploy
	$(CARGO) test -p lockcell-tests --test e2e -- --test-threads 1

# The load test, side by side with bare etcd and etcd's grpc-proxy (release build).
# Reports, tables and plots land in target/loadtest/.
# The container image (Containerfile) from the release binaries, with podman, tagged
# as deploy/kubernetes/kustomization.yaml names it; docs/deployment.md, "The image".
image: setup
	$(CARGO) build --release --workspace --bins
	sh deploy/image/image.sh build target/release

bench: setup
	$(CARGO) build --release --workspace --bins
	./target/release/lockcell-loadtest bench

bench-full: setup
	$(CARGO) build --release --workspace --bins
	./target/release/lockcell-loadtest bench --full

# Randomized fault runs (every fault kind per run, safety checker on) for DURATION.
DURATION ?= 20m
chaos: build
	./target/debug/lockcell-chaos --duration $(DURATION)

# docs/api.md from the comments of the .proto; `make test` fails while it is stale.
api-doc:
	$(CARGO) run -q -p lockcell-proto --bin lockcell-api-doc -- docs/api.md

# docs/configuration.md from the binaries' flags; `make test` fails while it is stale.
config-doc:
	$(CARGO) build -q -p lockcell-proxy -p lockcell-cell -p lockcell-client --bins
	{ cat docs/configuration.head.md; \
	  ./target/debug/lockcell-proxy --config-reference; \
	  ./target/debug/lockcell-cell --config-reference; \
	  ./target/debug/lockctl --config-reference; } > docs/configuration.md

lint: setup
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	# The cell crate without its audit trail, as the proxy builds it; and the proxy
	# free of the audit stores' dependencies.
	$(CARGO) clippy -p lockcell-cell --no-default-features -- -D warnings
	@if $(CARGO) tree -p lockcell-proxy -e normal --prefix none | grep -E '^(rusqlite|object_store|reqwest) '; then \
	  echo "lockcell-proxy depends on an audit store's crate (above): keep it behind lockcell-cell's audit feature"; exit 1; fi

fmt:
	$(CARGO) fmt --all

clean:
	$(CARGO) clean
	rm -rf $(DEV_DIR)
