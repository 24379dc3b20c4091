"""ringtrain's version: what ``ringcore.__version__`` says and the control handshake
announces (``engine.wire``), in a leaf so that neither imports the package's face."""

__version__ = "0.1.0"
