"""What the warm fork server (tests/warm_launch.py) also imports where it imports: peft, with
transformers under it (~3.5 CPU-s a process; LoRA's launched tests start eight). Any failure leaves
it to the processes that need it, which then import it themselves (and fail as a user's would)."""

import contextlib

with contextlib.suppress(Exception):  # absent or broken: not the fork server's concern
    import peft  # noqa: F401
