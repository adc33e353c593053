"""placeholder"""
def write_report(path, stats, limiter=None, sem=None):
    pass
