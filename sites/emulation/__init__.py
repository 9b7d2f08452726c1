"""What this machine cannot have, emulated: the WAN (and the precise timers it runs on), an
embedded etcd, a Slurm harness.
Imported by cpn and the tests only.
"""
