"""Models by name (core/models/hub.py): `--model org/name[:QUANT]` through
huggingface_hub, without a network.

Two Hubs stand in for huggingface.co: a cache directory laid out as
huggingface_hub lays it out (blobs, snapshots/<commit>/ links, refs/),
built here from local files and read with HF_HUB_OFFLINE=1; and a Hub on
loopback (tests/hub_fake.py: the API and resolve routes with ETag,
X-Repo-Commit, Content-Length and Range) pointed at by HF_ENDPOINT.

Oracles: the bytes of the files the repo was made from; the tokens the
same model generates when loaded from its local path; the Range header the
server saw; the one-line messages of the CLI.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pty
import select
import struct
import subprocess
import sys
import termios
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from hub_fake import FakeHub
from paged.core.engine.config import EngineConfig
from paged.core.models.files import resolve_model
from paged.core.models.hub import HubModelError, ModelName, RepoSpec, choose_files

GREEDY = dict(max_tokens=8, temperature=0.0)
SMALL = dict(device="cpu", max_model_len=128, max_num_seqs=4, kv_cache_memory="64MiB")


# -- tiny models -----------------------------------------------------------------

def tiny_gguf(path: Path, seed: int = 0, qtype=Q.Q8_0) -> Path:
    """A complete llama GGUF small enough to write in a test (46 KB)."""
    hidden, heads, kv, ff, vocab = 64, 2, 1, 128, 64
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([chr(ord("a") + i) for i in range(26)] + [f"<s{i}>" for i in range(vocab - 26)])
    w.add_token_types([1] * vocab)
    w.add_token_merges([])
    w.add_bos_token_id(29)
    w.add_eos_token_id(30)
    rng = np.random.default_rng(seed)
    hd = hidden // heads
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,),
              "blk.0.attn_norm.weight": (hidden,), "blk.0.ffn_norm.weight": (hidden,),
              "blk.0.attn_q.weight": (hidden, hidden), "blk.0.attn_k.weight": (kv * hd, hidden),
              "blk.0.attn_v.weight": (kv * hd, hidden), "blk.0.attn_output.weight": (hidden, hidden),
              "blk.0.ffn_gate.weight": (ff, hidden), "blk.0.ffn_up.weight": (ff, hidden),
              "blk.0.ffn_down.weight": (hidden, ff)}
    for name, shape in shapes.items():
        data = rng.standard_normal(shape).astype(np.float32)
        w.add_tensor(name, gguf.quants.quantize(data, qtype) if len(shape) == 2 else data,
                     raw_dtype=qtype if len(shape) == 2 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_folder_files(seed: int = 0) -> dict[str, bytes]:
    """A Hugging Face Llama folder (config, tokenizer, two safetensors shards
    and their index) as file name -> bytes, plus a consolidated copy the
    index does not name (which must not be fetched)."""
    from safetensors.torch import save

    from tokenizers import Tokenizer, models

    hidden, heads, kv, ff, vocab = 64, 2, 1, 128, 64
    hd = hidden // heads
    g = torch.Generator().manual_seed(seed)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden),
              "model.layers.0.input_layernorm.weight": (hidden,),
              "model.layers.0.post_attention_layernorm.weight": (hidden,),
              "model.layers.0.self_attn.q_proj.weight": (hidden, hidden),
              "model.layers.0.self_attn.k_proj.weight": (kv * hd, hidden),
              "model.layers.0.self_attn.v_proj.weight": (kv * hd, hidden),
              "model.layers.0.self_attn.o_proj.weight": (hidden, hidden),
              "model.layers.0.mlp.gate_proj.weight": (ff, hidden),
              "model.layers.0.mlp.up_proj.weight": (ff, hidden),
              "model.layers.0.mlp.down_proj.weight": (hidden, ff)}
    tensors = {k: torch.randn(s, generator=g) * 0.2 for k, s in shapes.items()}
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    files = {f: save({k: tensors[k] for k in keys}) for f, keys in shards.items()}
    files["consolidated.safetensors"] = save(tensors)
    files["model.safetensors.index.json"] = json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}).encode()
    files["config.json"] = json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": ff, "num_hidden_layers": 1, "num_attention_heads": heads,
        "num_key_value_heads": kv, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}).encode()
    vocab_map = {f"t{i}": i for i in range(vocab)}
    files["tokenizer.json"] = Tokenizer(models.WordLevel(vocab_map, unk_token="t0")).to_str().encode()
    files["tokenizer_config.json"] = json.dumps({"eos_token": "t2", "bos_token": "t1"}).encode()
    files["README.md"] = b"# tiny\n"
    return files


def greedy_tokens(model, **extra) -> list[list[int]]:
    from paged import LLM, SamplingParams

    llm = LLM(model, **SMALL, **extra)
    outs = llm.generate([[3, 4, 5], [7, 8, 9, 10]], SamplingParams(**GREEDY))
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory) -> dict[str, bytes]:
    d = tmp_path_factory.mktemp("gguf")
    return {"Q8_0": tiny_gguf(d / "a.gguf", 0).read_bytes(), "Q4_0": tiny_gguf(d / "b.gguf", 1, Q.Q4_0).read_bytes()}


@pytest.fixture
def hub_env(tmp_path, monkeypatch):
    """A fresh Hub cache; online unless a test says otherwise (huggingface_hub
    reads HF_HUB_OFFLINE once, at import: its constant is set here too)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    return tmp_path / "hub"


@pytest.fixture
def hub(hub_env, monkeypatch):
    with FakeHub() as fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        yield fake


def write_cache(cache: Path, repo_id: str, commit: str, files: dict[str, bytes], refs=("main",)) -> Path:
    """huggingface_hub's cache layout, by hand: blobs named by content hash,
    snapshots/<commit>/<path> relative links to them, refs/<name> -> commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    for path, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo / "snapshots" / commit / path
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return repo / "snapshots" / commit


# -- which files ------------------------------------------------------------------

def test_names_and_paths_are_told_apart(tmp_path):
    assert RepoSpec.parse("bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M") == \
        RepoSpec("bartowski/Llama-3.2-1B-Instruct-GGUF", "Q4_K_M")
    assert RepoSpec.parse("Qwen/Qwen2.5-0.5B-Instruct") == RepoSpec("Qwen/Qwen2.5-0.5B-Instruct")
    for path in ("/abs/model.gguf", "./org/name", "~/org/name", "a/b/c", "org/model.gguf", "model.gguf",
                 "org/na--me", "org/", "org"):
        assert RepoSpec.parse(path) is None, path


def test_choice_of_files_follows_llama_cpp():
    listing = ["README.md", "m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "m-Q8_0.gguf", "mmproj-m-f16.gguf",
               "big/m-Q6_K-00001-of-00002.gguf", "big/m-Q6_K-00002-of-00002.gguf"]
    spec = RepoSpec.parse
    assert choose_files(spec("o/m:q8_0"), listing).files == ["m-Q8_0.gguf"]
    assert choose_files(spec("o/m:Q4_K_M"), listing).files == ["m-Q4_K_M.gguf"]
    assert choose_files(spec("o/m:Q6_K"), listing).files == ["big/m-Q6_K-00001-of-00002.gguf",
                                                             "big/m-Q6_K-00002-of-00002.gguf"]
    assert choose_files(spec("o/m"), listing).files == ["m-Q4_K_M.gguf"]  # llama.cpp's default tag
    with pytest.raises(HubModelError, match=r"'Q4_K' matches 2 GGUF files in the repo: m-Q4_K_M.gguf, "
                                            r"m-Q4_K_S.gguf; name one"):
        choose_files(spec("o/m:Q4_K"), listing)
    with pytest.raises(HubModelError, match=r"no .gguf file in the repo matches 'IQ2_XS' \(they are: "):
        choose_files(spec("o/m:IQ2_XS"), listing)
    with pytest.raises(HubModelError, match="has 2 GGUF files in the repo: choose one with o/m:QUANT"):
        choose_files(spec("o/m"), ["a-Q8_0.gguf", "a-F16.gguf"])
    with pytest.raises(HubModelError, match=r"mmproj|nothing paged can serve"):
        choose_files(spec("o/m"), ["mmproj-f16.gguf", "README.md"])
    with pytest.raises(HubModelError, match=r"lacks part\(s\) 2 of 3"):
        choose_files(spec("o/m:Q2_K"), ["m-Q2_K-00001-of-00003.gguf", "m-Q2_K-00003-of-00003.gguf"])
    # safetensors first when the name has no tag, as vLLM does
    folder = ["config.json", "tokenizer.json", "model.safetensors", "m-Q8_0.gguf", "onnx/model.onnx"]
    assert choose_files(spec("o/m"), folder).files == ["config.json", "tokenizer.json", "model.safetensors"]
    assert choose_files(spec("o/m:Q8_0"), folder).files == ["m-Q8_0.gguf"]
    with pytest.raises(HubModelError, match="no tokenizer.json"):
        choose_files(spec("o/m"), ["config.json", "model.safetensors"])
    with pytest.raises(HubModelError, match=r"nothing paged can serve in the repo \(expected a .gguf file, or "
                                            r"config.json with \*.safetensors\) \(it has: adapter_config.json"):
        choose_files(spec("o/m"), ["adapter_config.json", "adapter_model.safetensors"])


# -- a cache laid out by hand, offline ------------------------------------------------

def test_offline_cache_serves_the_same_model_as_its_file(hub_env, monkeypatch, tmp_path, gguf_bytes):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    main, v1 = "a" * 40, "b" * 40
    write_cache(hub_env, "org/tiny-GGUF", main, {"tiny-Q8_0.gguf": gguf_bytes["Q8_0"],
                                                  "tiny-Q4_0.gguf": gguf_bytes["Q4_0"]})
    write_cache(hub_env, "org/tiny-GGUF", v1, {"tiny-Q8_0.gguf": gguf_bytes["Q4_0"]}, refs=("v1",))
    path = resolve_model("org/tiny-GGUF:Q8_0")
    assert path == hub_env / "models--org--tiny-GGUF" / "snapshots" / main / "tiny-Q8_0.gguf"
    assert path.read_bytes() == gguf_bytes["Q8_0"]
    assert resolve_model("org/tiny-GGUF:Q8_0", revision="v1").read_bytes() == gguf_bytes["Q4_0"]
    assert resolve_model("org/tiny-GGUF:q8_0", revision=v1).read_bytes() == gguf_bytes["Q4_0"]  # a commit
    local = tmp_path / "local.gguf"
    local.write_bytes(gguf_bytes["Q8_0"])
    assert greedy_tokens("org/tiny-GGUF:Q8_0") == greedy_tokens(str(local))
    local.write_bytes(gguf_bytes["Q4_0"])
    assert greedy_tokens("org/tiny-GGUF:Q8_0", revision="v1") == greedy_tokens(str(local))


def test_offline_without_the_files_is_one_line(hub_env, monkeypatch, gguf_bytes):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubModelError, match=r"^--model org/absent: revision 'main' is not in the Hugging Face "
                                            r"cache \(.*\) and HF_HUB_OFFLINE is set: download it once online, "
                                            r"or unset HF_HUB_OFFLINE$"):
        resolve_model("org/absent")
    write_cache(hub_env, "org/tiny-GGUF", "c" * 40, {"tiny-Q8_0.gguf": gguf_bytes["Q8_0"]})
    with pytest.raises(HubModelError, match="revision 'v2' is not in the Hugging Face cache"):
        resolve_model("org/tiny-GGUF", revision="v2")
    with pytest.raises(HubModelError, match=r"no .gguf file in the cached snapshot cccccccccccc matches 'Q4_0'"):
        resolve_model("org/tiny-GGUF:Q4_0")


def run_cli(*args: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "import sys; from paged.core.entrypoints.cli import main; "
                           "sys.exit(main())", "--device", "cpu", *args],
                          capture_output=True, text=True, env={**os.environ, **env}, timeout=timeout)


def test_cli_errors_are_one_line(hub_env, tmp_path):
    offline = {"HF_HUB_CACHE": str(hub_env), "HF_HUB_OFFLINE": "1"}
    r = run_cli("generate", "--model", "org/absent:Q4_K_M", "hi", env=offline)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"paged: error: --model org/absent:Q4_K_M: revision 'main' is not in the Hugging Face cache ({hub_env}) "
        "and HF_HUB_OFFLINE is set: download it once online, or unset HF_HUB_OFFLINE"]
    r = run_cli("generate", "--model", str(tmp_path / "nothing.gguf"), "--revision", "v1", "hi", env=offline)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "--revision 'v1': only for a model named on the Hugging Face Hub" in r.stderr
    # the Hub out of reach (a closed port) and nothing cached
    r = run_cli("generate", "--model", "org/absent", "hi",
                env={"HF_HUB_CACHE": str(hub_env), "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"})
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"paged: error: --model org/absent: revision 'main' is not in the Hugging Face cache ({hub_env}) and the "
        "Hub is unreachable (ConnectError): download it once online"], r.stderr


def test_revision_is_checked_and_travels_with_the_name():
    import pickle

    cfg = EngineConfig(model="org/name:Q8_0", revision="v1")
    assert cfg.model == "org/name:Q8_0" and cfg.model.revision == "v1"
    again = pickle.loads(pickle.dumps(cfg))  # tensor parallel ranks get the config pickled
    assert isinstance(again.model, ModelName) and again.model.revision == "v1"
    for bad in ("", " v1", "a b"):
        with pytest.raises(ValueError, match="--revision: expected a branch, tag or commit"):
            EngineConfig(model="org/name", revision=bad)
    with pytest.raises(ValueError, match=r"--revision 'v1': only for a model named on the Hugging Face Hub "
                                         r"\(--model org/name\), got --model None"):
        EngineConfig(revision="v1")


# -- the Hub on loopback ---------------------------------------------------------------

def test_download_then_offline(hub, hub_env, monkeypatch, gguf_bytes, capfd):
    commit = hub.add_repo("org/tiny-GGUF", {"tiny-Q8_0.gguf": gguf_bytes["Q8_0"],
                                            "tiny-Q4_0.gguf": gguf_bytes["Q4_0"], "README.md": b"hi"})
    path = resolve_model("org/tiny-GGUF:Q8_0")
    assert path == hub_env / "models--org--tiny-GGUF" / "snapshots" / commit / "tiny-Q8_0.gguf"
    assert path.read_bytes() == gguf_bytes["Q8_0"]
    assert (hub_env / "models--org--tiny-GGUF" / "refs" / "main").read_text() == commit
    err = capfd.readouterr().err
    assert f"paged: fetching org/tiny-GGUF:Q8_0 (tiny-Q8_0.gguf: 1 file, 46.5 KB) at {commit[:12]} from " \
           f"{hub.url} into {hub_env}" in err
    fetched = [p for p in hub.paths() if "/resolve/" in p]
    assert fetched == [f"/org/tiny-GGUF/resolve/{commit}/tiny-Q8_0.gguf"]  # only the chosen file
    # cached: no download again, and no word about one
    assert resolve_model("org/tiny-GGUF:Q8_0") == path
    assert [p for p in hub.paths() if "/resolve/" in p] == fetched
    assert "fetching" not in capfd.readouterr().err
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.requests.clear()
    assert resolve_model("org/tiny-GGUF:Q8_0") == path and hub.requests == []


def test_a_dropped_download_resumes_with_a_range_request(hub, gguf_bytes):
    # larger than huggingface_hub's 10 MB read chunk, so the first part is kept
    big = np.random.default_rng(3).integers(0, 256, 24 << 20, dtype=np.uint8).tobytes()
    commit = hub.add_repo("org/big-GGUF", {"big-Q8_0.gguf": big})
    hub.drop_once["big-Q8_0.gguf"] = 15 << 20
    path = resolve_model("org/big-GGUF", quiet=True)
    assert hashlib.sha256(path.read_bytes()).digest() == hashlib.sha256(big).digest()
    gets = [(p, r) for m, p, r in hub.requests if m == "GET" and "/resolve/" in p]
    assert [p for p, _ in gets] == [f"/org/big-GGUF/resolve/{commit}/big-Q8_0.gguf"] * 2
    assert gets[0][1] is None and gets[1][1].startswith("bytes=") and int(gets[1][1][6:-1]) >= 10 << 20


def test_split_gguf_fetches_every_part(hub, hub_env):
    parts = {f"Q2_K/m-Q2_K-0000{i}-of-00003.gguf": bytes([i]) * 1000 for i in (1, 2, 3)}
    commit = hub.add_repo("org/split-GGUF", {**parts, "m-Q8_0.gguf": b"x" * 10})
    with pytest.raises(HubModelError, match=r"m-Q2_K.gguf is a split GGUF of 3 parts .* merge them with "
                                            r"llama.cpp's `llama-gguf-split --merge m-Q2_K-00001-of-00003.gguf"):
        resolve_model("org/split-GGUF:q2_k", quiet=True)
    snapshot = hub_env / "models--org--split-GGUF" / "snapshots" / commit
    assert {p: (snapshot / p).read_bytes() for p in parts} == parts
    assert not (snapshot / "m-Q8_0.gguf").exists()


def test_safetensors_repo_serves_the_same_model_as_its_folder(hub, hub_env, tmp_path):
    files = tiny_folder_files()
    commit = hub.add_repo("org/tiny", files)
    path = resolve_model("org/tiny", quiet=True)
    assert path == hub_env / "models--org--tiny" / "snapshots" / commit
    fetched = sorted(p.rsplit("/", 1)[-1] for p in hub.paths() if "/resolve/" in p)
    assert fetched == ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                       "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"]
    local = tmp_path / "local"
    local.mkdir()
    for name in fetched:
        (local / name).write_bytes(files[name])
    assert greedy_tokens("org/tiny") == greedy_tokens(str(local))


def test_hub_errors_are_one_line(hub, hub_env, gguf_bytes):
    hub.add_repo("org/tiny-GGUF", {"tiny-Q8_0.gguf": gguf_bytes["Q8_0"], "tiny-Q4_0.gguf": gguf_bytes["Q4_0"]})
    hub.add_repo("org/docs", {"README.md": b"# no weights"})
    cases = {
        ("org/nope", None): rf"^--model org/nope: no such model on the Hub \({hub.url}\), nor a local file or "
                            r"folder \(a private repo needs HF_TOKEN\)$",
        ("org/tiny-GGUF", "v9"): r"^--model org/tiny-GGUF: the repo has no revision 'v9' \(--revision\)$",
        ("org/tiny-GGUF:Q", None): r"^--model org/tiny-GGUF:Q: 'Q' matches 2 GGUF files in the repo: "
                                   r"tiny-Q4_0.gguf, tiny-Q8_0.gguf; name one of them more exactly$",
        ("org/docs", None): r"^--model org/docs: nothing paged can serve in the repo .* \(it has: README.md\)$",
    }
    for (name, rev), pattern in cases.items():
        with pytest.raises(HubModelError, match=pattern):
            resolve_model(name, revision=rev, quiet=True)
    assert not [p for p in hub.paths() if "/resolve/" in p]  # nothing fetched for any of them


def test_revision_tag_downloads_that_commit(hub, gguf_bytes):
    hub.add_repo("org/tiny-GGUF", {"tiny-Q8_0.gguf": gguf_bytes["Q4_0"]}, branch="old", tags=("v1",))
    hub.add_repo("org/tiny-GGUF", {"tiny-Q8_0.gguf": gguf_bytes["Q8_0"]})
    assert resolve_model("org/tiny-GGUF", quiet=True).read_bytes() == gguf_bytes["Q8_0"]
    assert resolve_model(EngineConfig(model="org/tiny-GGUF", revision="v1").model,
                         quiet=True).read_bytes() == gguf_bytes["Q4_0"]


def test_the_hub_out_of_reach_falls_back_to_the_cache(hub_env, monkeypatch, gguf_bytes, caplog):
    snapshot = write_cache(hub_env, "org/tiny-GGUF", "d" * 40, {"tiny-Q8_0.gguf": gguf_bytes["Q8_0"]})
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    with caplog.at_level("INFO", logger="paged"):
        assert resolve_model("org/tiny-GGUF") == snapshot / "tiny-Q8_0.gguf"
    assert "the Hub is unreachable" in caplog.text


def _fetch_on(stderr_is_tty: bool, env: dict) -> str:
    """The stderr of a fetch by a fresh process whose stderr is a terminal
    (a pty) or a pipe."""
    code = "from paged.core.models.files import resolve_model; resolve_model('org/tiny-GGUF:Q8_0')"
    if not stderr_is_tty:
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              timeout=120).stderr
    master, slave = pty.openpty()
    # a terminal 120 columns wide (a new pty has none, and tqdm fits its bar into that)
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    out = b""
    while True:
        ready, _, _ = select.select([master], [], [], 120)
        try:
            chunk = os.read(master, 65536) if ready else b""
        except OSError:  # the child closed the pty
            chunk = b""
        if not chunk:
            break
        out += chunk
    proc.wait(30)
    os.close(master)
    return out.decode(errors="replace")


def test_progress_bar_on_a_terminal_only(tmp_path, gguf_bytes):
    with FakeHub() as fake:
        fake.add_repo("org/tiny-GGUF", {"tiny-Q8_0.gguf": gguf_bytes["Q8_0"]})
        env = {**os.environ, "HF_ENDPOINT": fake.url, "HF_HUB_OFFLINE": "0"}
        piped = _fetch_on(False, {**env, "HF_HUB_CACHE": str(tmp_path / "a")})
        tty = _fetch_on(True, {**env, "HF_HUB_CACHE": str(tmp_path / "b")})
    assert piped.strip().splitlines() == [line for line in piped.strip().splitlines()
                                          if line.startswith("paged: fetching")] and len(piped.splitlines()) == 1
    assert "paged: fetching org/tiny-GGUF:Q8_0" in tty and "100%" in tty and "tiny-Q8_0.gguf" in tty


def test_served_name_of_a_hub_name_is_the_name(tmp_path):
    from types import SimpleNamespace

    from paged.core.entrypoints.server.cli import _served_name

    engine = SimpleNamespace(model_path=str(tmp_path / "snapshots" / ("e" * 40) / "name-Q4_K_M.gguf"))
    args = SimpleNamespace(served_model_name=None, model="org/name-GGUF:Q4_K_M")
    assert _served_name(args, engine) == "org/name-GGUF:Q4_K_M"
    assert _served_name(SimpleNamespace(served_model_name="x", model=args.model), engine) == "x"
    local = SimpleNamespace(served_model_name=None, model=str(tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    assert _served_name(local, SimpleNamespace(model_path=local.model)) == "SmolLM2-135M-Instruct"
