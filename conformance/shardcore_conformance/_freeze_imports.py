"""The last module the fork server of :mod:`.launch` preloads: importing it freezes what the server
imported, so the cycle collector of each worker forked from it skips those objects
(:func:`.zygote.freeze_imports` says why). ``multiprocessing`` gives a fork server no other hook."""

from .zygote import freeze_imports

freeze_imports()
