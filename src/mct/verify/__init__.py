"""``mct verify``: the plain fp32 reference trainer (``reference``) and the step-by-step
comparison of an engine configuration against it (``compare``)."""
