"""Published GPU serving measurements: the data, its replay through the simulator, the fit and its report."""
