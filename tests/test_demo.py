"""What a newcomer runs first: the demo's model learns from its text, and `ssmops generate` runs a
checkpoint directory (mamba_ssm's and transformers' layouts, with and without tokenizer files)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import ssmops
from conftest import CPP_RUNNER_USABLE, REPO
from ssmops.__main__ import main
from ssmops.export import quiet_torch_deprecations
from ssmops.models import MambaConfig, MambaLMHeadModel

sys.path.insert(0, str(REPO / "examples"))
import demo  # noqa: E402


def test_demo_model_learns_english_bytes():
    """20 short steps (eager, seed 0; 4 windows of 64 bytes each, a sixteenth of the demo's batch) of
    the demo's model and training loop bring the held-out loss below the held-out text's own byte
    entropy: the lowest loss of any model that ignores context (the uniform guess is ln 256 = 5.55
    nats, the untrained model ~5.2), so only a model that has learnt to read the preceding bytes gets
    under it (these steps reach ~2.2 against a bound of ~3.1; 100 demo steps reach ~1.4)."""
    train_data, held_out = demo.load_text()
    counts = torch.bincount(held_out, minlength=256).double()
    freqs = counts[counts > 0] / counts.sum()
    context_free_bound = -(freqs * freqs.log()).sum().item()  # ~3.3 nats/byte for this text
    model = demo.build_model(seed=0)
    before = demo.held_out_loss(model, held_out)
    losses = []
    demo.train(model, train_data, steps=20, batch=4, seqlen=64, seed=0, compile=False,
               on_step=lambda _, loss: losses.append(loss))
    after = demo.held_out_loss(model, held_out)
    assert len(losses) == 20 and before > context_free_bound
    assert after < context_free_bound - 0.3, (before, after, context_free_bound)


@pytest.mark.slow
def test_demo_runs(tmp_path, request):
    """examples/demo.py end to end, shortened: training (eager: test_models.py compiles the same model's
    forward and loss and trains it), generation, the package checked in Python and (where CMake is) in
    C++, the backend table; the checkpoint it leaves is generated from.
    Where CMake is, the C++ runner is built first by the `cpp_runner` fixture, in the folder where the
    demo builds it (the demo's build then has nothing to do), once for this test and test_deploy's."""
    if CPP_RUNNER_USABLE:
        request.getfixturevalue("cpp_runner")
    args = ["--steps", "3", "--batch", "2", "--new-tokens", "4", "--eager", "--out", str(tmp_path)]
    env = {**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": "2"}  # 3 steps leave the runner's build nothing to overlap
    out = subprocess.run([sys.executable, "examples/demo.py", *args], cwd=REPO, capture_output=True, text=True,
                         timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    for expected in ("held-out loss after", "4 tokens:", "lm_aoti.pt2", "vs eager, max relative error", "vs default"):
        assert expected in out.stdout, out.stdout
    assert "FutureWarning" not in out.stderr, out.stderr[-3000:]
    assert (tmp_path / "lm_aoti.pt2").is_file() and (tmp_path / "pytorch_model.bin").is_file()


@pytest.mark.skipif(ssmops.available_backends()["cpu"] != "available", reason="needs the native operator library")
def test_demo_says_why_the_cpp_runner_is_skipped(monkeypatch):
    monkeypatch.setattr(demo.shutil, "which", lambda tool: None if tool == "cmake" else "/usr/bin/" + tool)
    process, reason = demo.start_cpp_build()
    assert process is None and reason.startswith("not run: cmake not found on PATH")


def test_demo_training_rejects_bad_arguments():
    with pytest.raises(ValueError, match="steps, batch and seqlen"):
        demo.train(demo.build_model(), torch.zeros(1000, dtype=torch.long), steps=0)


# --- ssmops generate --------------------------------------------------------------------------

TEXT = "The for statement is used to iterate over the elements of a sequence. " * 20


def _mamba_ssm_checkpoint(path, vocab_size=256):
    """A tiny random model in mamba_ssm's layout (config.json + pytorch_model.bin)."""
    torch.manual_seed(0)
    model = MambaLMHeadModel(MambaConfig(d_model=16, n_layer=1, vocab_size=vocab_size, ssm_cfg={"d_state": 4}))
    model.save_pretrained(path)
    return model.eval()


def _bpe_tokenizer(vocab_size=300):
    """A byte-level BPE tokenizer (the `tokenizers` library, which transformers installs), trained on TEXT."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    return tok


def _generate(capsys, *args):
    code = main(["generate", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def _greedy(model, ids, new_tokens, vocab_size):
    out = model.generate(torch.tensor([ids]), max_length=len(ids) + new_tokens, vocab_size=vocab_size)
    return out[0, len(ids):].tolist()


def test_generate_mamba_ssm_layout_without_tokenizer_uses_bytes(tmp_path, capsys):
    model = _mamba_ssm_checkpoint(tmp_path)
    code, out, err = _generate(capsys, tmp_path, "--prompt", "The for", "--max-new-tokens", 12)
    assert code == 0 and "no tokenizer files" in err and "tokens/s" in err
    expected = bytes(_greedy(model, list(b"The for"), 12, 256)).decode("utf-8", errors="replace")
    assert out == "The for" + expected + "\n"


def test_generate_samples_repeatably_with_a_seed(tmp_path, capsys):
    _mamba_ssm_checkpoint(tmp_path)
    args = (tmp_path, "--prompt", "x", "--max-new-tokens", 16, "--top-k", 0, "--temperature", 1.5, "--seed", 3)
    first, second = _generate(capsys, *args)[1], _generate(capsys, *args)[1]
    assert first == second
    assert first != _generate(capsys, *args[:-1], 4)[1]


def test_generate_reads_a_bare_tokenizer_json(tmp_path, capsys):
    tok = _bpe_tokenizer()
    model = _mamba_ssm_checkpoint(tmp_path, vocab_size=tok.get_vocab_size())
    tok.save(str(tmp_path / "tokenizer.json"))
    pytest.importorskip("transformers")
    code, out, err = _generate(capsys, tmp_path, "--prompt", "The for statement", "--max-new-tokens", 10)
    assert code == 0 and "tokenizer: " in err and "tokenizer.json" in err
    prompt = tok.encode("The for statement").ids
    assert out == "The for statement" + tok.decode(_greedy(model, prompt, 10, tok.get_vocab_size())) + "\n"


def test_generate_falls_back_to_bytes_without_transformers(tmp_path, capsys, monkeypatch):
    _mamba_ssm_checkpoint(tmp_path)
    _bpe_tokenizer(vocab_size=256).save(str(tmp_path / "tokenizer.json"))
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now fails
    code, _, err = _generate(capsys, tmp_path, "--prompt", "The", "--max-new-tokens", 4)
    assert code == 0 and "transformers is not installed" in err and "bytes" in err


def test_generate_transformers_layout_with_its_tokenizer(tmp_path, capsys):
    tf = pytest.importorskip("transformers")
    tok = _bpe_tokenizer()
    torch.manual_seed(0)
    config = tf.MambaConfig(vocab_size=tok.get_vocab_size(), hidden_size=16, state_size=4, num_hidden_layers=1)
    hf = tf.MambaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)  # config.json (model_type mamba) + model.safetensors
    tf.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(tmp_path)  # tokenizer_config.json + .json
    code, out, err = _generate(capsys, tmp_path, "--prompt", "The for", "--max-new-tokens", 8)
    assert code == 0 and "tokenizer_config.json" in err
    prompt = tok.encode("The for").ids
    ours = MambaLMHeadModel.from_hf(hf).eval()
    assert out == "The for" + tok.decode(_greedy(ours, prompt, 8, tok.get_vocab_size())) + "\n"
    # and the same continuation as transformers' own greedy decoding
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert out == "The for" + tok.decode(theirs[0, len(prompt):].tolist()) + "\n"


@pytest.mark.parametrize("layout", ["missing", "empty", "no-weights", "bad-config", "wrong-weights"])
def test_generate_bad_checkpoint_is_one_error_line(tmp_path, capsys, layout):
    target = tmp_path / "ckpt"
    if layout != "missing":
        target.mkdir()
    if layout == "no-weights":
        (target / "config.json").write_text(json.dumps(MambaConfig(d_model=16, n_layer=1).to_dict()))
    if layout == "bad-config":
        (target / "config.json").write_text("{not json")
    if layout == "wrong-weights":
        _mamba_ssm_checkpoint(target)
        (target / "config.json").write_text(json.dumps(MambaConfig(d_model=32, n_layer=1, vocab_size=256).to_dict()))
    code, out, err = _generate(capsys, target, "--prompt", "x")
    assert code == 1 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and str(target) in err


def test_generate_rejects_bad_arguments(tmp_path, capsys):
    _mamba_ssm_checkpoint(tmp_path)
    assert "error: --prompt encodes to no tokens" in _generate(capsys, tmp_path, "--prompt", "")[2]
    assert "--temperature must be > 0" in _generate(capsys, tmp_path, "--prompt", "x", "--top-k", 5,
                                                    "--temperature", 0)[2]
    with pytest.raises(SystemExit):
        main(["generate", str(tmp_path), "--prompt", "x", "--max-new-tokens", "0"])


@pytest.mark.slow  # a fresh interpreter
def test_python_m_ssmops_generate(tmp_path):
    """The command as a user types it: the text on stdout, notes and tokens/s on stderr; a bad path is one
    line on stderr and exit code 1, with no traceback."""
    _mamba_ssm_checkpoint(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ok = subprocess.run([sys.executable, "-m", "ssmops", "generate", str(tmp_path), "--prompt", "Hello",
                         "--max-new-tokens", "5"], capture_output=True, text=True, env=env, timeout=300)
    assert ok.returncode == 0 and ok.stdout.startswith("Hello") and "tokens/s" in ok.stderr, ok.stderr
    bad = subprocess.run([sys.executable, "-m", "ssmops", "generate", str(tmp_path / "nope"), "--prompt", "x"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines()[-1] == f"error: checkpoint_dir {str(tmp_path / 'nope')!r} is not a directory"


def test_quiet_torch_deprecations_hides_only_torchs_own():
    def warn_all():
        warnings.warn_explicit("internal", FutureWarning, "_trace.py", 1, module="torch.export._trace")
        warnings.warn_explicit("internal", DeprecationWarning, "_pytree.py", 1, module="torch.utils._pytree")
        warnings.warn_explicit("`isinstance(treespec, LeafSpec)` is deprecated", FutureWarning, "copyreg.py", 1,
                               module="copyreg")
        warnings.warn_explicit("yours", FutureWarning, "model.py", 1, module="my_models")
        warnings.warn_explicit("torch's", UserWarning, "_trace.py", 1, module="torch.export._trace")

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet_torch_deprecations():
            warn_all()
        assert [str(w.message) for w in seen] == ["yours", "torch's"]
        warn_all()  # and only within the block
        assert len(seen) == 2 + 5
