// Makes the prebuilt extension importable as `kvcompress._C` (setup.py builds it).
// Importing it loads the library, whose static initializers register torch.ops.kvcompress.*;
// the module itself defines nothing.
#include <Python.h>

static PyModuleDef kvcompress_module = {
    PyModuleDef_HEAD_INIT,
    "_C",                                                                     // m_name
    "kvcompress native kernels; they are reached through torch.ops.kvcompress",  // m_doc
    -1,       // m_size
    nullptr,  // m_methods
    nullptr,  // m_slots
    nullptr,  // m_traverse
    nullptr,  // m_clear
    nullptr,  // m_free
};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&kvcompress_module); }
