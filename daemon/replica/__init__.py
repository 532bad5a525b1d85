"""The in-memory replica: one backend of files in /dev/shm, their pages, locks and spares, and the table of replicas.

``backend.py`` writes a replica file (``MemoryStorage``: its pages filled directly, a spare's pages taken over),
``locks.py`` keeps committed replicas' pages locked in memory, ``folder.py`` names, makes and removes the files in the
daemon's /dev/shm folder, and ``table.py`` (``ReplicaStore``) decides which replicas and spares to keep and serve.
"""
