"""course.grader: autograde a class (instructors).

grading (the class loop, grades.csv, journal, feedback, gradebook), autograde (one notebook,
cell by cell, in a kernel inside a bubblewrap sandbox: sandbox, jupyter_kernel,
kernel_guard).
"""
