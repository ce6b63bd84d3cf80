"""The devices device-parametrized tests run on: the CPU, and CUDA where a GPU is present."""

import torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
