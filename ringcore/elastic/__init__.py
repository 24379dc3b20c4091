"""Elastic membership: generations of the ring published through the job's store.

``policy`` (the rules, as pure functions) and ``limits`` (min/max/reset/timeouts,
checked once in each launcher's own names), ``driver`` (the launcher's side, which
publishes generations by the policy), ``job`` (the launcher's control loop over the
driver: form, watch, re-form, stop), ``worker`` (a rank's side: wait for the next
generation, rejoin, leave). Internal to ringcore: launchers use ``ringcore.launch``,
training scripts ``ringcore.torch.elastic`` and its TensorFlow and Keras twins.
"""
