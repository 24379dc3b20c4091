"""Elastic membership: generations of the ring published through the job's store.

``policy`` (the rules, as pure functions), ``driver`` (the launcher's side, which
publishes generations by the policy), ``worker`` (a rank's side: wait for the next
generation, rejoin, leave). Internal to ringcore: launchers use ``ringcore.launch``,
training scripts ``ringcore.torch.elastic`` and its TensorFlow and Keras twins.
"""
