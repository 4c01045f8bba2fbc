"""What every dflash command shares, whatever its stage.

- `errors`: the base of the error family (`DflashError`) every CLI turns into one paragraph;
- `cli`: the click command classes, the exit-status table and the message shape;
- `config`: reading `--config FILE` (JSON or YAML, keys as the flags);
- `signals`: SIGINT/SIGTERM: stop after the unit of work in progress, or at once;
- `fsio`: atomic files and directories, fsync, advisory locks, stale temporaries;
- `devices`: the dtype names and the device choice of every command.
- `records`: the input record (JSONL) and its sidecar, read and validated for every stage.
- `positions`: how many positions a target takes, read from its config (extract, eval).

Nothing here imports torch at module level: `--help` of every command stays fast.
"""

from . import messages  # noqa: F401  (registers the package's finding renderers)
