"""Loading errors say what is wrong and fail at once: a missing local folder, an offline or unreachable hub."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from lora_kit.loading import load_model, looks_like_path, resolve_model

# Loads through the real entry point (resolve_model runs first, then transformers), in a fresh process
# so that huggingface_hub reads HF_ENDPOINT / HF_HUB_OFFLINE at import as a user's shell would set them.
LOAD = """
from lora_kit.loading import load_tokenizer
try:
    load_tokenizer("someorg/some-model")
except ValueError as e:
    print("ERROR", e)
"""


def _load_in_subprocess(tmp_path, **env) -> tuple[str, str]:
    full = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0", **env}
    p = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, timeout=120, env=full,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout, p.stderr


@pytest.mark.parametrize("path", ["./my-model", "/nonexistent/my-model", "models/org/my-model", "~/no-such-model"])
def test_missing_local_folder_says_it_does_not_exist(path):
    with pytest.raises(ValueError, match="does not exist") as e:
        resolve_model(path)
    assert "hub repo id" not in str(e.value) and "set model to a folder" in str(e.value)
    with pytest.raises(ValueError, match="does not exist"):
        load_model(path)  # the loader itself, not only the resolver
    assert looks_like_path(path)


def test_hub_ids_are_not_taken_for_paths():
    for hub_id in ("gpt2", "Qwen/Qwen2.5-0.5B", "meta-llama/Llama-3.1-8B"):
        assert not looks_like_path(hub_id)


def test_offline_hub_fails_at_once_with_what_to_do(tmp_path):
    # a listening "hub" that counts connections: offline, nothing may even try to reach it
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    try:
        out, err = _load_in_subprocess(tmp_path, HF_HUB_OFFLINE="1",
                                          HF_ENDPOINT=f"http://127.0.0.1:{server.getsockname()[1]}")
        with pytest.raises(socket.timeout):
            server.accept()[0].close()  # no connection is waiting in the backlog
    finally:
        server.close()
    assert "HF_HUB_OFFLINE=1 with no cached copy" in out and "hf download someorg/some-model" in out, out
    assert "is not a local folder" in out
    assert "Retrying" not in err  # no request at all, so no retry


def test_unreachable_hub_fails_without_retries(tmp_path):
    # port 9 (discard) on localhost: nothing listens, the connection is refused at once
    out, err = _load_in_subprocess(tmp_path, HF_ENDPOINT="http://127.0.0.1:9")
    assert "the hub (http://127.0.0.1:9) is unreachable" in out and "hf download someorg/some-model" in out, out
    assert "set model to that folder" in out
    assert "Retrying" not in err, err[-2000:]  # huggingface_hub logs each of its 5 retries ("Retrying in 2s ..."),
    # ~28 s before the check; benchmarks time things, tests don't (shared machines)


def test_existing_local_folder_is_used_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(tmp_path) == str(tmp_path)  # no hub check for a folder that exists
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_model(tmp_path.parent)


def test_unknown_model_in_estimate_fails_at_once_listing_catalog_names(tmp_path):
    # an unreachable hub (the slow case: ~25 s of retries before); HF_HUB_OFFLINE=1 takes the same path
    full = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0",
            "HF_ENDPOINT": "http://127.0.0.1:9"}
    p = subprocess.run([sys.executable, "-m", "lora_kit.ui.cli", "estimate", "--model", "qwen"], capture_output=True,
                       text=True, timeout=120, env=full, cwd=tmp_path)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "Unknown model 'qwen'. Catalog names like it: qwen2.5-0.5b" in p.stderr and "qwen3-8b" in p.stderr
    assert "Retrying" not in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
