"""Repository-root conftest: puts the repo root on sys.path so tests run from a checkout."""
