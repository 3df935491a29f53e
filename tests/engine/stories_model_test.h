// A test fixture holding stories260K (its llama2.c .bin); the test skips when the file is
// absent. Fixtures that set up more override SetUp, call this one first and return when
// NoModel().
#ifndef KVLENS_TESTS_ENGINE_STORIES_MODEL_TEST_H_
#define KVLENS_TESTS_ENGINE_STORIES_MODEL_TEST_H_

#include <memory>
#include <string>

#include "engine/model/model.h"
#include "gtest/gtest.h"
#include "tests/test_paths.h"

namespace kvlens::testing {

class StoriesModelTest : public ::testing::Test {
 protected:
  static std::string Path() { return TestData("stories260K/stories260K.bin"); }

  void SetUp() override {
    KVLENS_REQUIRE_FILE(Path());
    auto m = LoadModel({Path(), ""});
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = *std::move(m);
  }
  bool NoModel() const { return model_ == nullptr; }

  std::unique_ptr<Model> model_;
};

}  // namespace kvlens::testing

#endif  // KVLENS_TESTS_ENGINE_STORIES_MODEL_TEST_H_
