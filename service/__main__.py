import atexit
import os
import sys

from .cli import main

code = main()
# Leave without the interpreter's teardown: a library's native thread (torch's pools) still alive
# while C++ statics are destroyed can abort the process ("terminate called without an active
# exception") after the work is done. The exit functions (the disk tier's flush, logging) run first.
atexit._run_exitfuncs()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code or 0)
