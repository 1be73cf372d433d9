"""python tree.py TREE SCRIPT ARGS...: run SCRIPT with fsdpclip imported from TREE (bypassing the editable install)."""
import runpy, sys
tree, script = sys.argv[1], sys.argv[2]
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path.insert(0, tree)
sys.argv = sys.argv[2:]
import fsdpclip
assert fsdpclip.__file__.startswith(tree), fsdpclip.__file__
runpy.run_path(script, run_name="__main__")
