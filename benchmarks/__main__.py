from benchmarks.cli import guarded
from benchmarks.run import main

guarded(main)
