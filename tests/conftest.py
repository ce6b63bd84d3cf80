"""Shared test configuration: headless plotting and the device list for device-parametrized tests."""

import matplotlib
import torch

matplotlib.use("Agg")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
