"""Train several configs one after another in the same processes (one torchrun launch for many runs)."""

import sys

from posttrain.config import load_config
from posttrain.dist import exit_launched_rank
from posttrain.run import run

for path in sys.argv[1:]:
    run(load_config(path))
exit_launched_rank()  # as `posttrain train` ends a launched rank: no abort in the interpreter's teardown
