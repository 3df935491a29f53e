// NpzFile on archives numpy itself writes (np.savez, at test time): arrays of every float
// width and of 0–3 dimensions keep their names, shapes and values (arange, so every value
// is known); .npy format version 2 headers (np.lib.format) and zip64 records read too;
// Fortran order and compression refused by name; a member cut short refused.
#include "engine/model/npz.h"

#include <cstdlib>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/temp_dir.h"

namespace kvlens {
namespace {

class NpzTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::system("/usr/bin/python3 -c 'import numpy' >/dev/null 2>&1") != 0) {
      GTEST_SKIP() << "python3 with numpy not available";
    }
  }
  // Runs `code` with numpy as np and `path` bound to dir_/name; returns the path.
  std::string Write(const std::string& name, const std::string& code) {
    const std::string path = dir_.File(name);
    const std::string script = dir_.File("write.py");
    std::ofstream(script) << "import numpy as np\npath = '" << path << "'\n" << code << "\n";
    EXPECT_EQ(std::system(("/usr/bin/python3 " + script).c_str()), 0) << code;
    return path;
  }
  testing::ScopedTempDir dir_{"kvlens_npz"};
};

TEST_F(NpzTest, ArraysOfEveryFloatWidthAndRank) {
  const std::string path = Write("a.npz",
                                 "np.savez(path, w=np.arange(12, dtype=np.float32).reshape(3, 4), "
                                 "h=np.arange(5, dtype=np.float16) / 4, "
                                 "d=np.arange(24, dtype=np.float64).reshape(2, 3, 4) - 0.5, "
                                 "s=np.float32(7.25))");
  auto f = NpzFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_EQ((*f)->arrays().size(), 4u);
  const NpzArray* w = (*f)->Find("w");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->descr, "<f4");
  EXPECT_EQ(w->shape, (std::vector<int64_t>{3, 4}));
  auto wv = NpzFloats(*w);
  ASSERT_TRUE(wv.ok());
  for (int i = 0; i < 12; ++i) EXPECT_EQ((*wv)[i], i);
  auto hv = NpzFloats(*(*f)->Find("h"));
  ASSERT_TRUE(hv.ok());
  EXPECT_EQ(*hv, (std::vector<float>{0, 0.25f, 0.5f, 0.75f, 1.0f}));
  const NpzArray* d = (*f)->Find("d");
  EXPECT_EQ(d->shape, (std::vector<int64_t>{2, 3, 4}));
  auto dv = NpzFloats(*d);
  ASSERT_TRUE(dv.ok());
  EXPECT_EQ((*dv)[23], 22.5f);
  const NpzArray* s = (*f)->Find("s");
  EXPECT_TRUE(s->shape.empty());
  EXPECT_EQ((*NpzFloats(*s))[0], 7.25f);
  EXPECT_EQ((*f)->Find("missing"), nullptr);
}

TEST_F(NpzTest, VersionTwoHeaders) {
  const std::string path =
      Write("v2.npz",
            "import zipfile, io\n"
            "buf = io.BytesIO(); np.lib.format.write_array(buf, np.arange(6, dtype=np.float32), "
            "version=(2, 0))\n"
            "z = zipfile.ZipFile(path, 'w'); z.writestr('x.npy', buf.getvalue()); z.close()");
  auto f = NpzFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*NpzFloats(*(*f)->Find("x")))[5], 5.0f);
}

// zip64 records (archives past 4 GiB, Gemma Scope's widest SAEs): numpy's own writer with
// zipfile's 4 GiB limit lowered to 64 bytes, so every member and the end record go zip64.
TEST_F(NpzTest, Zip64Records) {
  const std::string path = Write("z64.npz",
                                 "import zipfile\nzipfile.ZIP64_LIMIT = 64\n"
                                 "np.savez(path, a=np.arange(40, dtype=np.float32), "
                                 "b=np.arange(30, dtype=np.float64).reshape(5, 6))\n"
                                 "d = open(path, 'rb').read()\n"
                                 "assert b'PK\\x06\\x06' in d and b'PK\\x06\\x07' in d");
  auto f = NpzFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*NpzFloats(*(*f)->Find("a")))[39], 39.0f);
  EXPECT_EQ((*f)->Find("b")->shape, (std::vector<int64_t>{5, 6}));
  EXPECT_EQ((*NpzFloats(*(*f)->Find("b")))[29], 29.0f);
}

TEST_F(NpzTest, RefusedByName) {
  auto expect = [](const std::string& path, const std::string& needle) {
    auto f = NpzFile::Open(path);
    EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument) << f.status();
    EXPECT_NE(f.status().message().find(needle), std::string::npos) << f.status();
  };
  expect(Write("f.npz", "np.savez(path, w=np.asfortranarray(np.ones((3, 4), np.float32)))"),
         "array w: fortran_order is not False");
  expect(Write("c.npz", "np.savez_compressed(path, w=np.ones(4, np.float32))"),
         "array w is compressed");
  expect(Write("t.npz",
               "import zipfile, io\n"
               "buf = io.BytesIO(); np.save(buf, np.arange(6, dtype=np.float32))\n"
               "z = zipfile.ZipFile(path, 'w'); z.writestr('x.npy', buf.getvalue()[:-4]); "
               "z.close()"),
         "array x: holds 20 bytes of data, <f4 × (6,) needs 24");
  expect(Write("o.npz",
               "import zipfile\n"
               "z = zipfile.ZipFile(path, 'w'); z.writestr('notes.txt', 'hello'); z.close()"),
         "member notes.txt is not a .npy array");
  EXPECT_EQ(NpzFile::Open(dir_.File("none.npz")).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvlens
