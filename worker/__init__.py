"""Code that runs only inside the spawned checkpoint worker process.

The folder is `worker/`; it installs as the package `asyncckpt_worker` (see pyproject.toml).
"""
