"""Experiments with NSA-aware metrics, each one command writing markdown + JSON + PNG (docs/experiments.md):

- ``python -m nsa_titan.experiments.ac_planner``: GA/AC trade-off (smallest fitting AC ratio per GPU count and
  local batch, fake process groups for GPU counts beyond the machine, step time per setting);
- ``python -m nsa_titan.experiments.dp_compare``: FSDP2 vs FSDP1 vs DDP on 1 and N GPUs, with and without AC;
- ``python -m nsa_titan.experiments.compile_report``: compile on/off (tokens/s, memory, compile time, recompiles),
  NSA next to dense SDPA attention.
``probe.py`` is the planner's measurement; ``common.py`` runs the trainer and writes the reports.
"""
