"""Running it: the launcher, the rendered model repository, the tritonserver process, the watchdog and /proc."""
