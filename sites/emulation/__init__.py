"""What this machine cannot have, emulated: the WAN, an embedded etcd, a Slurm harness.
Imported by cpn and the tests only.
"""
