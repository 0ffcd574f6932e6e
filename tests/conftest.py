"""Shared fixtures. Every test process runs torch single-threaded: CI has two cores and
several test processes (servers, ranks) may share them."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

torch.set_num_threads(1)
