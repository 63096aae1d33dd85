"""``python -m smp_tf.launch``: start the processes of a job on this machine.

The launcher itself lives in `smp_tf.distributed.launcher`; this module is
its command-line entry point (also installed as ``smp-tf-launch``).
"""

from __future__ import annotations

import sys

from smp_tf.distributed.launcher import (
    EXIT_TIMEOUT,
    EXIT_USAGE,
    TERMINATE_GRACE_S,
    assign_gpus,
    main,
    visible_gpus,
)

__all__ = ["EXIT_TIMEOUT", "EXIT_USAGE", "TERMINATE_GRACE_S", "assign_gpus", "main", "visible_gpus"]

if __name__ == "__main__":
    sys.exit(main())
