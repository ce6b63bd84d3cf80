"""Independent numpy references for the calibration tests (plain loops, no package code)."""

import numpy as np


def random_probs(rng: np.random.Generator, n: int, k: int, scale: float = 2.5,
                 dtype=np.float64) -> np.ndarray:
    """Softmax of Gaussian logits: (n, k) probabilities with a spread of confidences."""
    logits = rng.normal(size=(n, k)) * scale
    probs = np.exp(logits - logits.max(1, keepdims=True))
    return (probs / probs.sum(1, keepdims=True)).astype(dtype)


def calibrated_labels(rng: np.random.Generator, probs: np.ndarray) -> np.ndarray:
    """Labels drawn from the rows of probs (a perfectly calibrated model)."""
    cumulative = np.cumsum(probs.astype(np.float64), axis=1)
    draws = rng.random(probs.shape[0])[:, None] * cumulative[:, -1:]
    return np.minimum((draws > cumulative).sum(1), probs.shape[1] - 1)


def reference_bins(confidence: np.ndarray, correct: np.ndarray, n_bins: int):
    """Per-bin (count, mean confidence, accuracy) with [a, b) bins and the last bin closed."""
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    rows = []
    for b in range(n_bins):
        upper = confidence <= edges[b + 1] if b == n_bins - 1 else confidence < edges[b + 1]
        member = (confidence >= edges[b]) & upper
        count = int(member.sum())
        if count:
            rows.append((count, confidence[member].mean(), correct[member].mean()))
        else:
            rows.append((0, np.nan, np.nan))
    return rows


def reference_ece_mce(probs: np.ndarray, labels: np.ndarray, n_bins: int = 15):
    """Top-label ECE and MCE by explicit loops (argmax prediction)."""
    probs = probs.astype(np.float64)
    confidence = probs.max(1)
    correct = (probs.argmax(1) == labels).astype(np.float64)
    rows = reference_bins(confidence, correct, n_bins)
    n = len(labels)
    ece = sum(c / n * abs(a - m) for c, m, a in rows if c)
    mce = max(abs(a - m) for c, m, a in rows if c)
    return ece, mce


def reference_brier(probs: np.ndarray, labels: np.ndarray) -> float:
    onehot = np.eye(probs.shape[1])[labels]
    return float(((probs.astype(np.float64) - onehot) ** 2).sum(1).mean())


def reference_nll(probs: np.ndarray, labels: np.ndarray, floor: float = 1e-12) -> float:
    picked = probs.astype(np.float64)[np.arange(len(labels)), labels]
    return float(-np.log(np.maximum(picked, floor)).mean())
