"""Config loading: precedence, parsing, error messages, --help, shipped TOML files."""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

import pytest

from nsa_titan.config import ConfigError, JobConfig, job_config_to_dict, load_job_config
from nsa_titan.config.manager import field_docs, section_fields, sections

REPO = Path(__file__).resolve().parents[1]
SHIPPED = {
    "debug_model.toml": {"model.flavor": "debug", "training.seq_len": 512, "training.local_batch_size": 4,
                         "training.steps": 150, "optimizer.lr": 1e-3, "lr_scheduler.warmup_steps": 15,
                         "training.mixed_precision": "bf16", "metrics.log_freq": 10, "metrics.val_freq": 50},
    "m7c_125m.toml": {"model.flavor": "m7c", "training.seq_len": 2048, "training.local_batch_size": 8,
                      "training.steps": 1000, "optimizer.lr": 6e-4, "compile.mode": "auto"},
    "nsa_1b.toml": {"model.flavor": "1b", "training.seq_len": 8192, "training.local_batch_size": 1,
                    "training.steps": 1000, "optimizer.lr": 3e-4},
    "nsa_qwen7b.toml": {"model.flavor": "qwen7b", "training.seq_len": 8192, "training.local_batch_size": 1,
                        "training.steps": 1000, "optimizer.lr": 3e-4},
}


def _get(cfg: JobConfig, dotted: str):
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def test_every_shipped_config_is_listed():
    assert sorted(p.name for p in (REPO / "train_configs").glob("*.toml")) == sorted(SHIPPED)


@pytest.mark.parametrize("name", sorted(SHIPPED))
@pytest.mark.parametrize("extra", [[], ["--compile.enable"]])
def test_shipped_configs_load_and_validate(name, extra):
    """Each file as shipped, alone and compiled (README: CONFIG_FILE=... ./run_train.sh [--compile.enable])."""
    path = REPO / "train_configs" / name
    cfg = load_job_config(["--config", str(path), *extra])
    for dotted, value in SHIPPED[name].items():
        assert _get(cfg, dotted) == value, (name, dotted)
    assert cfg.job.config_file == str(path)


def _toml(tmp_path: Path, text: str, name: str = "job.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _error(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_job_config(argv)
    return str(info.value)


# --- defaults and precedence ---------------------------------------------------------------------


def test_defaults_match_the_documented_values():
    cfg = load_job_config([])
    expected = {
        "training.seq_len": 1024, "training.local_batch_size": 8, "training.grad_accum_steps": 1,
        "training.steps": 300, "training.max_norm": 1.0, "training.mixed_precision": "bf16",
        "training.device": "auto", "training.seed": 42, "training.deterministic": False,
        "optimizer.name": "adamw", "optimizer.lr": 3e-4, "optimizer.betas": [0.9, 0.95],
        "optimizer.eps": 1e-8, "optimizer.weight_decay": 0.1, "optimizer.fused": "auto",
        "lr_scheduler.warmup_steps": 20, "lr_scheduler.decay_type": "cosine",
        "lr_scheduler.min_lr_ratio": 0.1, "lr_scheduler.wsd_decay_ratio": 0.2,
        "data.dataset": "stdlib", "data.path": None, "data.tokenizer": "byte", "data.hf_split": "train",
        "data.hf_text_field": "text", "data.val_fraction": 0.01, "data.retrieval_num_pairs": 16,
        "data.retrieval_num_queries": 16, "data.retrieval_key_len": 1, "data.retrieval_value_len": 1,
        "data.retrieval_queries": "repeat", "data.retrieval_unique_values": False, "data.retrieval_min_gap": None,
        "data.retrieval_filler": "corpus", "data.retrieval_mix": 0.0,
        "metrics.log_freq": 10, "metrics.jsonl_file": "metrics.jsonl", "metrics.enable_tensorboard": False,
        "metrics.val_freq": 0, "metrics.val_steps": 8, "compile.enable": False, "compile.fullgraph": True,
        "job.dump_folder": "./outputs", "job.description": "", "model.flavor": "debug",
    }
    for dotted, value in expected.items():
        assert _get(cfg, dotted) == value, dotted
    assert cfg.model.overrides() == {}


def test_cli_beats_toml_beats_defaults(tmp_path):
    path = _toml(tmp_path, "[training]\nsteps = 50\nseed = 7\n[optimizer]\nlr = 1e-3\n")
    cfg = load_job_config(["--config", path, "--training.steps", "60", "--optimizer.lr=2e-3"])
    assert cfg.training.steps == 60          # CLI over TOML
    assert cfg.optimizer.lr == 2e-3          # CLI (= form) over TOML
    assert cfg.training.seed == 7            # TOML over default
    assert cfg.training.seq_len == 1024      # default
    assert cfg.job.config_file == path


def test_cli_override_before_config_flag_still_wins(tmp_path):
    path = _toml(tmp_path, "[training]\nsteps = 50\n")
    assert load_job_config(["--training.steps", "9", "--config", path]).training.steps == 9


def test_config_file_alias_and_equals_form(tmp_path):
    path = _toml(tmp_path, "[training]\nsteps = 33\n")
    assert load_job_config(["--job.config_file", path]).training.steps == 33
    assert load_job_config([f"--config={path}"]).training.steps == 33


def test_repeated_override_last_wins():
    assert load_job_config(["--training.steps", "5", "--training.steps", "6"]).training.steps == 6


# --- value parsing -------------------------------------------------------------------------------


def test_bool_parsing():
    assert load_job_config(["--compile.enable"]).compile.enable is True
    assert load_job_config(["--compile.enable", "--training.steps", "3"]).compile.enable is True
    assert load_job_config(["--compile.fullgraph", "false"]).compile.fullgraph is False
    assert load_job_config(["--compile.fullgraph=False"]).compile.fullgraph is False
    assert load_job_config(["--training.deterministic", "1"]).training.deterministic is True
    assert load_job_config(["--model.shared_kv"]).model.shared_kv is True
    msg = _error(["--compile.enable", "maybe"])
    assert "compile.enable" in msg and "'maybe'" in msg and "bool" in msg
    assert "compile.enable" in _error(["--compile.enable=maybe"])


def test_list_parsing(tmp_path):
    assert load_job_config(["--optimizer.betas", "0.8,0.99"]).optimizer.betas == [0.8, 0.99]
    assert load_job_config(["--optimizer.betas", "[0.85, 0.9]"]).optimizer.betas == [0.85, 0.9]
    from_toml = load_job_config(["--config", _toml(tmp_path, "[optimizer]\nbetas = [0.7, 0.8]\n")])
    assert from_toml.optimizer.betas == [0.7, 0.8]
    msg = _error(["--optimizer.betas", "0.9,abc"])
    assert "optimizer.betas" in msg and "list[float]" in msg


def test_union_literal_or_bool_and_optional_fields():
    assert load_job_config(["--optimizer.fused", "auto"]).optimizer.fused == "auto"
    assert load_job_config(["--optimizer.fused", "true"]).optimizer.fused is True
    assert load_job_config(["--optimizer.fused"]).optimizer.fused is True
    assert load_job_config(["--optimizer.fused=false"]).optimizer.fused is False
    cfg = load_job_config(["--model.n_layers", "2", "--model.attn_impl", "reference", "--data.path", "none"])
    assert cfg.model.overrides() == {"n_layers": 2, "attn_impl": "reference"}
    assert cfg.data.path is None


def test_numbers():
    assert load_job_config(["--training.steps", "1e3"]).training.steps == 1000
    assert isinstance(load_job_config(["--optimizer.lr", "1"]).optimizer.lr, float)
    msg = _error(["--training.steps", "2.5"])
    assert "training.steps" in msg and "int" in msg


def test_toml_int_accepted_for_float_but_not_bool_for_int(tmp_path):
    assert load_job_config(["--config", _toml(tmp_path, "[optimizer]\nlr = 1\n")]).optimizer.lr == 1.0
    msg = _error(["--config", _toml(tmp_path, "[training]\nsteps = true\n")])
    assert "training.steps" in msg and "int" in msg


# --- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, must_contain", [
    (["--trainig.steps", "3"], ["trainig", "did you mean 'training'", "valid sections"]),
    (["--training.stepz", "3"], ["stepz", "did you mean 'steps'", "seq_len"]),
    (["--model.seq_len", "3"], ["seq_len", "training.seq_len"]),
    (["--training.steps", "abc"], ["training.steps", "'abc'", "int"]),
    (["--model.attn_impl", "refernce"], ["model.attn_impl", "'torch'", "'reference'", "did you mean 'reference'"]),
    (["--training.mixed_precision", "fp16"], ["training.mixed_precision", "'bf16'", "'fp32'"]),
    (["--lr_scheduler.decay_type", "cosin"], ["lr_scheduler.decay_type", "'wsd'", "did you mean 'cosine'"]),
    (["--data.dataset", "wiki"], ["data.dataset", "'stdlib'", "'hf'"]),
    (["--model.flavor", "debgu"], ["model.flavor", "debgu", "did you mean 'debug'", "m7c"]),
    (["--training.steps"], ["--training.steps", "needs a value", "int"]),
    (["--training.steps", "--compile.enable"], ["--training.steps", "needs a value"]),
    (["steps=3"], ["steps=3", "--section.key value"]),
    (["--steps", "3"], ["--steps", "--section.key"]),
    (["--confg", "x.toml"], ["--confg", "did you mean 'config'"]),
    (["--compile.mode", "reduce-overhead"], ["compile.mode", "--compile.enable"]),
    (["--data.restart_positions"], ["data.restart_positions", "--data.document_mask"]),
    (["--compile.enable", "--compile.mode", "cudagraphs"], ["compile.mode", "'reduce-overhead'"]),
    # a whole-step CUDA graph (components/step_graph.py): what it cannot capture is named with its fix
    (["--compile.step_graph", "--metrics.nsa_diagnostics", "false", "--compile.enable", "--compile.mode",
      "reduce-overhead"], ["compile.mode", "'reduce-overhead'", "--compile.mode default"]),
    (["--compile.step_graph", "--metrics.nsa_diagnostics", "false", "--parallelism.data_parallel", "ddp"],
     ["compile.step_graph", "'ddp'", "--parallelism.data_parallel fsdp2"]),
    (["--compile.step_graph", "--metrics.nsa_diagnostics", "false", "--parallelism.fsdp_unshard_early"],
     ["parallelism.fsdp_unshard_early", "--compile.step_graph"]),
    (["--compile.step_graph", "--metrics.nsa_diagnostics", "false", "--parallelism.fsdp_cpu_offload"],
     ["parallelism.fsdp_cpu_offload", "--compile.step_graph"]),
    (["--compile.step_graph"], ["metrics.nsa_diagnostics", "--metrics.nsa_diagnostics false"]),
    (["--compile.step_graph", "--metrics.nsa_diagnostics", "false", "--training.device", "cpu"],
     ["compile.step_graph", "training.device", "--training.device cuda"]),
    (["--compile.step_graph_warmup", "0"], ["compile.step_graph_warmup", ">= 1"]),
])
def test_cli_errors_name_key_and_fix(argv, must_contain):
    msg = _error(argv)
    for part in must_contain:
        assert part in msg, (part, msg)


@pytest.mark.parametrize("text, must_contain", [
    ("[trainig]\nsteps = 3\n", ["trainig", "did you mean 'training'"]),
    ("[training]\nstepz = 3\n", ["stepz", "did you mean 'steps'"]),
    ("[training]\nsteps = \"ten\"\n", ["training.steps", "'ten'", "int"]),
    ("[model]\nattn_impl = \"cuda\"\n", ["model.attn_impl", "'torch'", "'reference'"]),
    ("[model]\nflavor = \"huge\"\n", ["model.flavor", "huge", "debug", "1b"]),
    ("steps = 3\n", ["steps", "[section]"]),
    ("training = 3\n", ["training", "[training]"]),
    ("[training]\nsteps = = 3\n", ["TOML syntax error", "line 2"]),
])
def test_toml_errors_name_file_key_and_fix(tmp_path, text, must_contain):
    path = _toml(tmp_path, text, "bad.toml")
    msg = _error(["--config", path])
    assert "bad.toml" in msg or "model.flavor" in msg  # file errors name the file; flavor names the key
    for part in must_contain:
        assert part in msg, (part, msg)


def test_missing_or_unreadable_config_file(tmp_path):
    assert "nope.toml" in _error(["--config", str(tmp_path / "nope.toml")])
    assert str(tmp_path) in _error(["--config", str(tmp_path)])  # a directory


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("argv, field", [
    (["--training.steps", "0"], "training.steps"),
    (["--training.seq_len", "0"], "training.seq_len"),
    (["--training.local_batch_size", "0"], "training.local_batch_size"),
    (["--training.grad_accum_steps", "0"], "training.grad_accum_steps"),
    (["--training.max_norm", "0"], "training.max_norm"),
    (["--optimizer.lr", "0"], "optimizer.lr"),
    (["--optimizer.lr", "-1e-3"], "optimizer.lr"),
    (["--optimizer.betas", "0.9"], "optimizer.betas"),
    (["--optimizer.betas", "0.9,1.5"], "optimizer.betas"),
    (["--optimizer.eps", "0"], "optimizer.eps"),
    (["--optimizer.weight_decay", "-0.1"], "optimizer.weight_decay"),
    (["--lr_scheduler.warmup_steps", "-1"], "lr_scheduler.warmup_steps"),
    (["--lr_scheduler.min_lr_ratio", "1.5"], "lr_scheduler.min_lr_ratio"),
    (["--data.val_fraction", "1.0"], "data.val_fraction"),
    (["--data.val_fraction", "-0.1"], "data.val_fraction"),
    (["--data.retrieval_mix", "2"], "data.retrieval_mix"),
    (["--data.retrieval_num_pairs", "0"], "data.retrieval_num_pairs"),
    (["--data.retrieval_queries", "distinct", "--data.retrieval_num_queries", "17"], "data.retrieval_num_queries"),
    (["--data.retrieval_min_gap", "-1"], "data.retrieval_min_gap"),
    (["--data.dataset", "text_files"], "data.path"),
    (["--metrics.log_freq", "0"], "metrics.log_freq"),
    (["--metrics.val_freq", "-1"], "metrics.val_freq"),
    (["--metrics.val_steps", "0"], "metrics.val_steps"),
    (["--model.n_layers", "0"], "model.n_layers"),
])
def test_range_checks_name_the_field(argv, field):
    msg = _error(argv)
    assert field in msg and ("must" in msg or "required" in msg or "needs" in msg), msg


def test_model_section_is_generated_from_nsa_model_args():
    """Every NSAModelArgs field is a [model] key with the field's type (optional) and doc; model_args() applies them."""
    from nsa_titan.models import MODEL_FLAVORS, NSAModelArgs

    model_keys = section_fields(sections(JobConfig)["model"])
    assert list(model_keys) == ["flavor", *(f.name for f in dataclasses.fields(NSAModelArgs))]
    arg_types = typing.get_type_hints(NSAModelArgs)
    for key, tp in model_keys.items():  # optional versions of the model's own types: choices cannot drift apart
        assert key == "flavor" or tp == arg_types[key] | None, key
    assert field_docs(sections(JobConfig)["model"])["window"].startswith("w: sliding-window length")
    args = load_job_config(["--model.flavor", "m7c", "--model.rope_theta", "5e5", "--model.n_layers", "2"]).model_args()
    assert (args.rope_theta, args.n_layers, args.dim) == (5e5, 2, MODEL_FLAVORS["m7c"].dim)
    assert "model.norm_eps: must be > 0" in _error(["--model.norm_eps", "0"])


def test_model_consistency_checked_against_seq_len():
    msg = _error(["--training.seq_len", "4096"])  # debug flavor covers 1024 positions
    assert "max_seq_len" in msg
    assert load_job_config(["--training.seq_len", "4096", "--model.max_seq_len", "4096"]).training.seq_len == 4096


def test_retrieval_gap_must_cover_the_window():
    # debug flavor: window 64; a shorter gap would let the sliding window answer the queries.
    msg = _error(["--data.dataset", "retrieval", "--data.retrieval_min_gap", "63"])
    assert "data.retrieval_min_gap=63" in msg and "model.window=64" in msg and "--data.retrieval_min_gap 64" in msg
    cfg = load_job_config(["--data.dataset", "retrieval", "--data.retrieval_min_gap", "64"])
    assert cfg.data.retrieval_min_gap == 64
    assert load_job_config(["--data.retrieval_min_gap", "8"]).data.retrieval_min_gap == 8  # no retrieval: unused


# --- help, print-config, dict --------------------------------------------------------------------


def test_help_lists_every_field_with_type_default_and_doc(capsys):
    with pytest.raises(SystemExit) as info:
        load_job_config(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    secs = sections(JobConfig)
    assert set(secs) == {f.name for f in dataclasses.fields(JobConfig)}
    for name, cls in secs.items():
        assert f"[{name}]" in out
        docs = field_docs(cls)
        defaults = cls()
        for key in section_fields(cls):
            line = next((ln for ln in out.splitlines() if ln.strip().startswith(f"--{name}.{key} ")), None)
            assert line is not None, f"--{name}.{key} missing from --help"
            assert f"default: {getattr(defaults, key)!r}" in line
            assert docs.get(key), f"{name}.{key} has no docstring below it"
            assert docs[key].splitlines()[0] in out


def test_help_wins_over_bad_arguments(capsys):
    with pytest.raises(SystemExit) as info:
        load_job_config(["--nonsense.key", "1", "-h"])
    assert info.value.code == 0
    assert "--training.steps" in capsys.readouterr().out


def test_print_config_round_trips(tmp_path, capsys):
    argv = ["--config", str(REPO / "train_configs" / "debug_model.toml"), "--training.steps", "17",
            "--optimizer.betas", "0.8,0.9", "--job.description", 'quote " and \\ back', "--model.n_layers", "2"]
    with pytest.raises(SystemExit) as info:
        load_job_config(argv + ["--print-config"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    reloaded = load_job_config(["--config", _toml(tmp_path, text, "printed.toml")])
    original = job_config_to_dict(load_job_config(argv))
    again = job_config_to_dict(reloaded)
    original["job"].pop("config_file"), again["job"].pop("config_file")
    assert again == original


def test_job_config_to_dict_is_json_serialisable():
    d = job_config_to_dict(load_job_config(["--model.n_layers", "2"]))
    assert json.loads(json.dumps(d))["model"]["n_layers"] == 2
    assert set(d) == set(sections(JobConfig))


def test_compile_mode_auto_resolves_to_default_under_a_step_graph():
    """compile.step_graph captures the whole step: 'auto' must not add per-block graphs inside it, on one GPU too."""
    argv = ["--compile.enable", "--compile.mode", "auto", "--metrics.nsa_diagnostics", "false"]
    assert load_job_config(argv).compile.effective_mode("cuda", False) == "reduce-overhead"
    graphed = load_job_config([*argv, "--compile.step_graph"]).compile
    assert graphed.effective_mode("cuda", False) == "default" and not graphed.uses_cudagraphs("cuda", False)


@pytest.mark.parametrize("mode, device_type, data_parallel, expected", [
    ("auto", "cuda", False, "reduce-overhead"),  # one GPU: CUDA graphs
    ("auto", "cuda", True, "default"),  # data parallel hooks run between the blocks: no graphs
    ("auto", "cpu", False, "default"),
    ("default", "cuda", False, "default"),
    ("reduce-overhead", "cuda", False, "reduce-overhead"),
    ("max-autotune-no-cudagraphs", "cuda", False, "max-autotune-no-cudagraphs"),
])
def test_compile_mode_auto_resolves_per_run(mode, device_type, data_parallel, expected):
    cc = load_job_config(["--compile.enable", "--compile.mode", mode]).compile
    assert cc.effective_mode(device_type, data_parallel) == expected
    assert cc.uses_cudagraphs(device_type, data_parallel) == (expected == "reduce-overhead")
    off = load_job_config(["--compile.mode", mode] if mode == "default" else []).compile
    assert not off.uses_cudagraphs(device_type, data_parallel)  # compile off: never graphs


def test_fsdp_blocks_per_unit_is_for_fsdp2_and_positive():
    assert load_job_config(["--parallelism.fsdp_blocks_per_unit", "2"]).parallelism.fsdp_blocks_per_unit == 2
    assert "must be >= 1" in _error(["--parallelism.fsdp_blocks_per_unit", "0"])
    msg = _error(["--parallelism.data_parallel", "ddp", "--parallelism.fsdp_blocks_per_unit", "2"])
    assert "parallelism.fsdp_blocks_per_unit" in msg and "use fsdp2" in msg


def test_fsdp_unshard_early_is_for_fsdp2():
    assert load_job_config(["--parallelism.fsdp_unshard_early"]).parallelism.fsdp_unshard_early
    for dp in ("fsdp1", "ddp"):
        msg = _error(["--parallelism.data_parallel", dp, "--parallelism.fsdp_unshard_early"])
        assert "parallelism.fsdp_unshard_early" in msg and "use fsdp2" in msg
