"""Small process primitives shared by the launcher and the services, importing no package of
ours (so ``launch`` and every service may import it without an import cycle):
``procutil.parent_death``, a process asks the kernel to kill it when its parent exits;
``procutil.faults``, the tests' fault points (a process stops itself or others at a named point)."""
